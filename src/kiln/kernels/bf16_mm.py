"""Matmuls on dense bf16 weights on CPU: whether oneDNN's prepacked bf16 path runs here, and
kiln's bf16_gemm (fp32 arithmetic) for CPUs without bf16 instructions, beside torch's matmul
as the reference; the LM head's fp32-output product on kiln's kernel or, on AMX CPUs past the
dispatch's row count (kiln.kernels.isa.gemm_dispatch), oneDNN's AMX GEMM. The linear methods
that use them live in kiln.models.layers (onednn.py, cpu_bf16.py). Tests:
tests/kernels/test_gemm.py, tests/kernels/test_amx_dispatch.py.
"""

from __future__ import annotations

import functools
import logging
import os

import torch
import torch.nn.functional as F

from kiln.kernels import cpu
from kiln.kernels.isa import GemmPath, gemm_dispatch, kernel_tuning

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


@functools.cache
def bf16_matmul_emulated() -> bool:
    """Whether torch's bf16 matmul on this CPU is emulated (no oneDNN bf16 kernels: AVX2 CPUs
    without AVX-512 BW or AVX-NE-CONVERT), so bf16 activations go faster through fp32 GEMM."""
    return not onednn_available(torch.bfloat16)


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
    where the CPU has them), on AMX CPUs oneDNN's AMX GEMM from the dispatch's row count on,
    else torch's matmul on widened copies (the reference).

    A token's logits do not depend on its batch within either path; on AMX CPUs they may
    differ in the last fp32 bit between a batch below the row count and one above it."""
    if weight.dtype != torch.bfloat16 or x.device.type != "cpu":
        return F.linear(x.float(), weight.float())
    if x.dtype == torch.bfloat16 and gemm_dispatch().path(x.shape[0]) is GemmPath.ONEDNN:
        return onednn_bf16_linear_fp32(x, weight)
    if cpu.load():
        return torch.ops.kiln.bf16_gemm_f32(x, weight)
    if x.is_cuda and x.dtype == weight.dtype == torch.bfloat16 and _CUDA_MM_FP32:
        # cuBLAS writes its fp32 sums as fp32, with no widened copy of the weight
        return torch.ops.aten.mm.dtype(x, weight.t(), torch.float32)
    return F.linear(x.float(), weight.float())


# rows of the weight widened to fp32 at a time (4 MB: the copy stays in cache for the GEMM)
_WIDENED_TILE_ELEMENTS = 1 << 20


def onednn_bf16_linear_fp32(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`bf16_linear_fp32` on oneDNN: torch's bf16 linear cannot write fp32, so both operands
    are widened to fp32 (exactly: they are bf16 values) and multiplied with oneDNN's "bf16"
    fp32 precision (fpmath mode bf16), which lets it round fp32 inputs to bf16, a no-op here,
    and run its bf16 kernels with fp32 sums and an fp32 output: AMX tiles where the CPU has
    them (elsewhere oneDNN keeps fp32 FMAs, the same values up to summation order). The weight
    is widened a row tile at a time, so the fp32 copy is never the whole matrix."""
    xf = x.float()
    step = max(1, _WIDENED_TILE_ELEMENTS // weight.shape[1])
    matmul = torch.backends.mkldnn.matmul
    before = matmul.fp32_precision
    try:
        matmul.fp32_precision = "bf16"
        tiles = [F.linear(xf, weight[r:r + step].float())
                 for r in range(0, weight.shape[0], step)]
    finally:
        matmul.fp32_precision = before
    return tiles[0] if len(tiles) == 1 else torch.cat(tiles, dim=-1)


# torch >= 2.8 has `mm(..., out_dtype)` for bf16 inputs on CUDA
_CUDA_MM_FP32 = hasattr(torch.ops.aten.mm, "dtype")


def _kernel(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.kiln.bf16_gemm(x, weight)
