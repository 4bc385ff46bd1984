"""Dense bf16 matmuls on weights packed for AVX512-BF16 dot products (kiln::bf16_vnni_mm).

`pack_vnni(W)` turns W [N, K] into [ceil(N/16), ceil(K/2), 16, 2] (zero-padded): each block of
16 output rows stores its k-pairs in order with the 16 rows' pairs side by side, so one
dot-product instruction reads one 64-byte line and the weights stream from memory front to back
(kernels/cpu/gemm_vnni.cpp; why: docs/decisions/0013). `vnni_mm` is the product in bf16
(rounded once) or fp32. Tests: tests/kernels/test_bf16_vnni.py.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from kiln.kernels import cpu

BLOCK = 16  # output rows per packed block


@functools.cache
def vnni_available() -> bool:
    """kiln's kernels built here with AVX512-BF16 dot products."""
    return cpu.load() and bool(torch.ops.kiln.bf16_vnni_available())


def pack_vnni(weight: torch.Tensor) -> torch.Tensor:
    """W bf16 [N, K] as [ceil(N/16), ceil(K/2), 16, 2], zero-padded rows and columns."""
    n, k = weight.shape
    padded = F.pad(weight, (0, k % 2, 0, -n % BLOCK))
    blocks, pairs = padded.shape[0] // BLOCK, padded.shape[1] // 2
    return padded.view(blocks, BLOCK, pairs, 2).permute(0, 2, 1, 3).contiguous()


def unpack_vnni(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """W [n, k] back from `pack_vnni`'s layout (exact)."""
    blocks, pairs = packed.shape[:2]
    return packed.permute(0, 2, 1, 3).reshape(blocks * BLOCK, pairs * 2)[:n, :k].contiguous()


def vnni_mm(x: torch.Tensor, packed: torch.Tensor, n: int, fp32_out: bool = False
            ) -> torch.Tensor:
    """x bf16 [M, K] @ W^T from W's packed copy: [M, n] in bf16, or fp32 with `fp32_out`."""
    return torch.ops.kiln.bf16_vnni_mm(x, packed, n, fp32_out)
