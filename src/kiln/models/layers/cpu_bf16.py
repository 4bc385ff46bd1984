"""Dense bf16 linear layers on CPUs without bf16 arithmetic (AVX2, no AVX-512 BW/BF16).

oneDNN cannot prepack bf16 weights there, and torch's generic bf16 matmul runs at about
16 GFLOP/s whatever the token count (measured on a 2-core AVX2 AMD EPYC, torch 2.13): a
4-token speculative verify step costs four decode steps and prefill runs ~10x slower than in
fp32. This method keeps the weights in bf16 (half the bytes of fp32, which decode streams from
memory every step) and does the arithmetic in fp32: kiln's `bf16_gemm` kernel for up to
BF16_GEMM_MAX_TOKENS tokens (each weight row widened in registers and read once per 8 tokens),
and a widened copy through fp32 GEMM for more (prefill, where compute dominates).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from kiln.models.layers.linear import (
    NO_SCALE,
    DenseLinearMethod,
    StackTensors,
    register_linear_method,
)

# Measured per call (2 threads, weights cycled through 32 copies so they come from memory;
# `python benchmarks/cpu_bf16.py`, AVX2 EPYC): kernel vs widen + fp32 GEMM on 576x1536 is 98
# vs 374 us at 2 tokens, 329 vs 548 at 16, 681 vs 1409 at 32, 1386 vs 1931 at 64; on 1536x576
# the widened copy wins from 64 tokens (1864 vs 1717).
BF16_GEMM_MAX_TOKENS = int(os.environ.get("KILN_BF16_GEMM_MAX_TOKENS", "32"))


def cpu_bf16_available(dtype: torch.dtype) -> bool:
    """True for bf16 weights where kiln's vectorized bf16_gemm kernel built."""
    if dtype != torch.bfloat16:
        return False
    from kiln.runner import cpu_ops

    return cpu_ops.load() and bool(torch.ops.kiln.bf16_gemm_vectorized())


def widened_mm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight bf16 [N, K]^T in fp32 arithmetic, rounded once to x's dtype."""
    if x.shape[0] <= BF16_GEMM_MAX_TOKENS:
        return _kernel(x, weight)
    return F.linear(x.float(), weight.float()).to(x.dtype)


def _kernel(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.kiln.bf16_gemm(x, weight)


@register_linear_method("dense-bf16-fp32")
class CpuBf16LinearMethod(DenseLinearMethod):
    """DenseLinearMethod whose matmul widens bf16 weights to fp32 (see the module docstring)."""

    def apply(self, layer, x):
        flat = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        if layer.bias is None:
            out = widened_mm(flat, layer.weight)
        else:  # the bias joins the fp32 sum: one rounding, as in torch's F.linear
            out = (widened_mm(flat.float(), layer.weight) + layer.bias.float()).to(x.dtype)
        return out if x.dim() == 2 else out.reshape(*x.shape[:-1], out.shape[-1])

    def stack_tensors(self, layer) -> StackTensors | None:
        """The bf16 weight for the stack's bf16_gemm, which serves decode-sized steps only."""
        if layer.bias is not None or layer.weight.dtype != torch.bfloat16:
            return None
        return StackTensors(layer.weight, NO_SCALE, plain_bf16=True,
                            max_tokens=BF16_GEMM_MAX_TOKENS)
