"""Matmuls on dense bf16 weights on CPU: whether oneDNN's prepacked bf16 path runs here, and
kiln's bf16_gemm (fp32 arithmetic) for CPUs without bf16 instructions, beside torch's matmul
as the reference. The linear methods that use them live in kiln.models.layers (onednn.py,
cpu_bf16.py). Tests: tests/kernels/test_gemm.py.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F

from kiln.kernels import cpu
from kiln.kernels.isa import kernel_tuning

log = logging.getLogger(__name__)

# Measured per call (2 threads, weights cycled through 32 copies so they come from memory;
# `python benchmarks/cpu_bf16.py`, AVX2 EPYC): kernel vs widen + fp32 GEMM on 576x1536 is 98
# vs 374 us at 2 tokens, 329 vs 548 at 16, 681 vs 1409 at 32, 1386 vs 1931 at 64; on 1536x576
# the widened copy wins from 64 tokens (1864 vs 1717).
BF16_GEMM_MAX_TOKENS = int(os.environ.get("KILN_BF16_GEMM_MAX_TOKENS",
                                          kernel_tuning().bf16_gemm_max_tokens))


def onednn_available(dtype: torch.dtype) -> bool:
    """oneDNN prepacking works for bf16 weights on CPUs with mkldnn support."""
    if dtype != torch.bfloat16 or not torch.backends.mkldnn.is_available():
        return False
    try:
        w = torch.ones(8, 8, dtype=dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 1)
        out = torch.ops.mkldnn._linear_pointwise(torch.ones(1, 8, dtype=dtype), packed, None,
                                                 "none", [], "")
        return bool(out[0, 0] == 8)
    except (RuntimeError, AttributeError) as exc:
        log.info("oneDNN linear unavailable (%s); using torch's reference matmul", exc)
        return False


def bf16_gemm_available(dtype: torch.dtype) -> bool:
    """True for bf16 weights where kiln's vectorized bf16_gemm kernel built."""
    if dtype != torch.bfloat16:
        return False
    return cpu.load() and bool(torch.ops.kiln.bf16_gemm_vectorized())


def widened_mm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight bf16 [N, K]^T in fp32 arithmetic, rounded once to x's dtype: kiln's
    bf16_gemm up to BF16_GEMM_MAX_TOKENS tokens, a widened copy through fp32 GEMM beyond."""
    if x.shape[0] <= BF16_GEMM_MAX_TOKENS:
        return _kernel(x, weight)
    return F.linear(x.float(), weight.float()).to(x.dtype)


def bf16_linear_fp32(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight bf16 [N, K]^T as fp32 [M, N], from the fp32 sums, never rounded to
    bf16 (the LM head's logits): kiln's `bf16_gemm_f32` (AVX512-BF16 dot products on bf16 x
    where the CPU has them), else torch's matmul on widened copies (the reference)."""
    if weight.dtype == torch.bfloat16 and x.device.type == "cpu" and cpu.load():
        return torch.ops.kiln.bf16_gemm_f32(x, weight)
    if x.is_cuda and x.dtype == weight.dtype == torch.bfloat16 and _CUDA_MM_FP32:
        # cuBLAS writes its fp32 sums as fp32, with no widened copy of the weight
        return torch.ops.aten.mm.dtype(x, weight.t(), torch.float32)
    return F.linear(x.float(), weight.float())


# torch >= 2.8 has `mm(..., out_dtype)` for bf16 inputs on CUDA
_CUDA_MM_FP32 = hasattr(torch.ops.aten.mm, "dtype")


def _kernel(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.kiln.bf16_gemm(x, weight)
