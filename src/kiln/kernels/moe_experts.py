"""A mixture-of-experts layer's routed experts in one C++ call (kiln::moe_experts_vnni).

Each expert's gate/up [2I, H] and down [H, I] weights, VNNI-packed as kiln's dense bf16
linears pack them (kiln.kernels.bf16_vnni), are stacked by expert into one tensor per
projection ([E, 2I/16, H/2, 16, 2] and [E, H/16, I/2, 16, 2]); the kernel groups a step's
(token, slot) pairs by expert itself, runs every active expert's gate/up, silu * up and down
in one parallel region, and returns the routing-weighted sum per token. A step reads only
the experts it routes to. Why this layout and split: docs/decisions/0015. Torch reference:
the per-expert path of kiln.models.layers.moe.FusedExperts (tests/kernels/test_moe_kernel.py).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

from kiln.kernels.bf16_vnni import vnni_available

# KILN_FUSED_MOE=0 keeps every step on the per-expert path (to compare the two)
FUSED_MOE_ENABLED = os.environ.get("KILN_FUSED_MOE", "1") != "0"
# rows of one register tile of the VNNI kernel (gemm_vnni.cpp): an expert with this many rows
# is a compute-bound GEMM whose launch cost no longer matters
TILE_ROWS = 8


@functools.cache
def fused_moe_available() -> bool:
    """kiln's kernels built here with AVX512-BF16, the fused expert kernel among them."""
    return vnni_available() and hasattr(torch.ops.kiln, "moe_experts_vnni")


@dataclass(frozen=True, eq=False)
class StackedExperts:
    """One layer's held experts, VNNI-packed and stacked: slot s is the s-th held expert."""

    gate_up: torch.Tensor  # bf16 [E, 2I/16, H/2, 16, 2]
    down: torch.Tensor  # bf16 [E, H/16, I/2, 16, 2]


def fused_max_tokens(num_experts: int, top_k: int) -> int:
    """The largest step the fused kernel serves. Below it the experts' GEMMs are small and
    the per-expert path pays a Python dispatch per active expert on top of the same tiles;
    from T * k >= 8 * E on, the average active expert has a full 8-row tile (a
    compute-bound GEMM, decision 0015), the dispatch is a few percent of it, and prefill
    keeps the per-expert path and its smaller scratch."""
    return max(1, (TILE_ROWS * num_experts - 1) // top_k)  # T * k < 8 E


def moe_experts_vnni(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
                     stacked: StackedExperts, owned: torch.Tensor | None = None
                     ) -> torch.Tensor:
    """x bf16 [T, H], experts int64 [T, k] (slots of `stacked`), weights fp32 [T, k] ->
    sum_j weights[t, j] * Expert_{experts[t, j]}(x[t]) as bf16 [T, H]; with `owned` (bool
    [T, k]) only the marked pairs count (expert parallelism: the others may name any slot)."""
    return torch.ops.kiln.moe_experts_vnni(x, experts, weights, stacked.gate_up, stacked.down,
                                           owned)
