"""Dense bf16 linear layers on CPUs without bf16 arithmetic (AVX2, no AVX-512 BW/BF16).

oneDNN cannot prepack bf16 weights there, and torch's generic bf16 matmul runs at about
16 GFLOP/s whatever the token count (measured on a 2-core AVX2 AMD EPYC, torch 2.13): a
4-token speculative verify step costs four decode steps and prefill runs ~10x slower than in
fp32. This method keeps the weights in bf16 (half the bytes of fp32, which decode streams from
memory every step) and does the arithmetic in fp32: kiln's `bf16_gemm` kernel for up to
BF16_GEMM_MAX_TOKENS tokens (each weight row widened in registers and read once per 8 tokens),
and a widened copy through fp32 GEMM for more (prefill, where compute dominates); both in
kiln.kernels.bf16_mm.
"""

from __future__ import annotations

import torch

from kiln.kernels.bf16_mm import BF16_GEMM_MAX_TOKENS, widened_mm
from kiln.models.layers.linear import (
    NO_SCALE,
    DenseLinearMethod,
    StackTensors,
    register_linear_method,
)


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
