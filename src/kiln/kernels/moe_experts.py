"""A mixture-of-experts layer's routed experts in one C++ call (kiln/kernels/cpu/moe.cpp).

Each expert's gate/up [2I, H] and down [H, I] weights, in the layout of kiln's dense decode
kernels (bf16 VNNI-packed as kiln.kernels.bf16_vnni packs them: [E, 2I/16, H/2, 16, 2] and
[E, H/16, I/2, 16, 2]; weight-only int8 packed for AVX512-VNNI dot products as
kiln.kernels.int8_vnni packs them: uint8 [E, 2I/16, H/4, 16, 4] and [E, H/16, I/4, 16, 4]; or
int8 rows as int8_gemv reads them: [E, 2I, H] and [E, H, I]; int8 with per-row scales), are
stacked by expert into one tensor per projection; the kernel
groups a step's (token, slot) pairs by expert itself, runs every active expert's gate/up,
silu * up and down in one parallel region, and returns the routing-weighted sum per token. A step reads only
the experts it routes to. Why this layout and split: docs/decisions/0015. Torch reference:
the per-expert path of kiln.models.layers.experts.FusedExperts (tests/kernels/test_moe_kernel.py).
"""

from __future__ import annotations

import enum
import functools
import os
from dataclasses import dataclass

import torch

from kiln.kernels import cpu
from kiln.kernels.bf16_vnni import vnni_available
from kiln.kernels.int8_vnni import int8_vnni_available

# KILN_FUSED_MOE=0 keeps every step on the per-expert path (to compare the two)
FUSED_MOE_ENABLED = os.environ.get("KILN_FUSED_MOE", "1") != "0"
# rows of one register tile of the VNNI kernel (gemm_vnni.cpp): an expert with this many rows
# is a compute-bound GEMM whose launch cost no longer matters
TILE_ROWS = 8


class ExpertFormat(enum.Enum):
    """The expert weight formats the fused kernel reads (kiln's dense decode kernels' layouts)."""

    BF16_VNNI = "bf16-vnni"  # kiln.models.layers.vnni: AVX512-BF16 CPUs
    # kiln.quant's weight-only int8 with per-row scales, packed for int8_vnni_mm: AVX512-VNNI
    # CPUs (the activations as three base-256 digits, integer dot products; decision 0017)
    INT8_VNNI = "int8-vnni"
    INT8 = "int8"  # the same as plain int8 rows (fp32 FMAs): any CPU, or KILN_INT8_VNNI=0


@functools.cache
def fused_moe_available(fmt: ExpertFormat = ExpertFormat.BF16_VNNI) -> bool:
    """kiln's kernels built here, with the fused expert kernel for `fmt` (bf16 needs
    AVX512-BF16, packed int8 AVX512-VNNI)."""
    if fmt is ExpertFormat.BF16_VNNI:
        return vnni_available() and hasattr(torch.ops.kiln, "moe_experts_vnni")
    if fmt is ExpertFormat.INT8_VNNI:
        return int8_vnni_available() and hasattr(torch.ops.kiln, "moe_experts_int8_vnni")
    return cpu.load() and hasattr(torch.ops.kiln, "moe_experts_int8")


@dataclass(frozen=True, eq=False)
class StackedExperts:
    """One layer's held experts in one tensor per projection: slot s is the s-th held expert."""

    format: ExpertFormat
    # bf16 [E, 2I/16, H/2, 16, 2] (BF16_VNNI), uint8 [E, 2I/16, H/4, 16, 4] (INT8_VNNI) or
    # int8 [E, 2I, H] (INT8)
    gate_up: torch.Tensor
    # bf16 [E, H/16, I/2, 16, 2], uint8 [E, H/16, I/4, 16, 4] or int8 [E, H, I]
    down: torch.Tensor
    gate_up_scale: torch.Tensor | None = None  # int8 formats: fp32 [E, 2I, 1]
    down_scale: torch.Tensor | None = None  # int8 formats: fp32 [E, H, 1]


def fused_max_tokens(num_experts: int, top_k: int) -> int:
    """The largest step the fused kernel serves. Below it the experts' GEMMs are small and
    the per-expert path pays a Python dispatch per active expert on top of the same tiles;
    from T * k >= 8 * E on, the average active expert has a full 8-row tile (a
    compute-bound GEMM, decision 0015), the dispatch is a few percent of it, and prefill
    keeps the per-expert path and its smaller scratch."""
    return max(1, (TILE_ROWS * num_experts - 1) // top_k)  # T * k < 8 E


def moe_experts(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
                stacked: StackedExperts, owned: torch.Tensor | None = None) -> torch.Tensor:
    """x bf16 [T, H], experts int64 [T, k] (slots of `stacked`), weights fp32 [T, k] ->
    sum_j weights[t, j] * Expert_{experts[t, j]}(x[t]) as bf16 [T, H]; with `owned` (bool
    [T, k]) only the marked pairs count (expert parallelism: the others may name any slot)."""
    if stacked.format is ExpertFormat.BF16_VNNI:
        return torch.ops.kiln.moe_experts_vnni(x, experts, weights, stacked.gate_up,
                                               stacked.down, owned)
    op = torch.ops.kiln.moe_experts_int8_vnni if stacked.format is ExpertFormat.INT8_VNNI \
        else torch.ops.kiln.moe_experts_int8
    return op(x, experts, weights, stacked.gate_up, stacked.gate_up_scale, stacked.down,
              stacked.down_scale, owned)
