"""kiln's GPU kernels, written in Triton, each beside the torch reference it must match.

Modules (entry functions take and return torch tensors; docs/triton_kernels.md lists them):

- `reference`: the plain torch definition of every kernel below (imports torch only).
- `kv_cache`: `write_kv`, K/V of the step's tokens into their paged cache slots.
- `decode_attention`: `paged_decode_attention` (one query token per sequence, GQA, split along
  the sequence then reduced) and `choose_num_splits`.
- `prefill_attention`: `paged_prefill_attention` (a chunk of queries per sequence over its
  cached prefix, causal, with kiln's draft-tree masks).
- `norm_rotary`: `rms_norm`, `fused_add_rms_norm`, `rotary_inplace`.
- `quant_gemv`: `weight_only_gemv`, int8 or fp8 weights with one scale per output row.
- `tiles` (dot products, tile sizes), `checks` (argument checks), `bench` (kernel timings).

Without a CUDA device Triton can only run kernels in its interpreter (`TRITON_INTERPRET=1`,
numpy on the CPU, on CPU tensors): importing this package sets that variable then, before any
kernel is defined, so the same code is what CI tests on the CPU and what a GPU compiles.
`INTERPRETED` says which mode this process runs in. Triton reads the variable when a kernel is
decorated, so it must be set before the first kernel module is imported; this package's
__init__ always runs first.

This package is rank 0 (kiln.kernels): it imports torch and triton, nothing else of kiln.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
