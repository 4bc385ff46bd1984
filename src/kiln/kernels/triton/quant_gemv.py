"""Weight-only quantized GEMV for small batches: x [M, K] @ (W [N, K] * scale [N, 1])^T, with
W in kiln's "int8" or "fp8" format (kiln.quant.formats: int8 or float8_e4m3fn codes, one fp32
scale per output row).

Reference: reference.weight_only_gemv. Decode is memory-bound: the kernel reads each weight
byte once for all M rows (M up to a tile, a few tokens), widens codes to the activation dtype
(exact: int8 and e4m3 values are bf16 numbers), accumulates in fp32 and applies the row scale
once at the end. Larger batches belong to a dequantize + cuBLAS path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.kernels.triton import INTERPRETED
from kiln.kernels.triton.checks import check_out, check_same_device
from kiln.kernels.triton.tiles import dot, dot_mode

WEIGHT_DTYPES = (torch.int8, torch.float8_e4m3fn)
TILE_M = 16  # tl.dot's smallest tile: rows of x past M are masked
TILE_N = 16  # outputs per program: N / 16 programs keep every SM streaming weights
# the most rows a linear sends here (kiln.quant.linear): one tile of rows reads each weight
# byte once; past it every further tile reads the weights again, and dequantize + cuBLAS wins
MAX_ROWS = TILE_M


def tile_k(dtype: torch.dtype) -> int:
    """Inputs per loop step: 32 under the interpreter (tiny shapes cross steps); on a GPU the
    widest step that compiles for sm_90 without spilling (gpu_compile.py): 512 for 16-bit
    activations, 64 for fp32 (IEEE dot products hold more registers)."""
    if INTERPRETED:
        return 32
    return 64 if dtype == torch.float32 else 512


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, scale_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 FP8: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    # program (tile of BLOCK_N outputs, tile of BLOCK_M rows of x)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + m[:, None].to(tl.int64) * stride_xm + k[None, :],
                    mask=(m < M)[:, None] & (k < K)[None, :], other=0.0)
        w = tl.load(w_ptr + n[:, None].to(tl.int64) * stride_wn + k[None, :],
                    mask=(n < N)[:, None] & (k < K)[None, :], other=0)
        if FP8:  # loaded as bytes (a masked lane is 0, not an fp8 NaN), read as e4m3
            w = w.to(tl.float8e4nv, bitcast=True)
        # through fp32 (exact either way): Triton 3.9's interpreter casts int8 to bf16 wrongly
        w = w.to(tl.float32).to(x.dtype)
        acc += dot(x, tl.trans(w), PRECISION, UPCAST)
    scale = tl.load(scale_ptr + n, mask=n < N, other=0.0).to(tl.float32)
    out = acc * scale[None, :]
    tl.store(out_ptr + m[:, None].to(tl.int64) * stride_om + n[None, :],
             out.to(out_ptr.dtype.element_ty), mask=(m < M)[:, None] & (n < N)[None, :])


def weight_only_gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (fp32/bf16/fp16, rows contiguous) @ (weight [N, K] int8 or float8_e4m3fn,
    contiguous, * scale [N, 1] or [N] fp32)^T -> [M, N] in x's dtype. `out`: an [M, N]
    buffer to write into, returned."""
    _check_gemv(x, weight, scale)
    (rows, inner), cols = x.shape, weight.shape[0]
    out = check_out(out, (rows, cols), x.dtype, x.device)
    if rows == 0 or cols == 0:
        return out
    precision, upcast = dot_mode(x.dtype)
    grid = (triton.cdiv(cols, TILE_N), triton.cdiv(rows, TILE_M))
    fp8 = weight.dtype == torch.float8_e4m3fn
    codes = weight.view(torch.uint8) if fp8 else weight
    _gemv_kernel[grid](x, codes, scale, out, rows, cols, inner, x.stride(0), weight.stride(0),
                       out.stride(0), BLOCK_M=TILE_M, BLOCK_N=TILE_N, BLOCK_K=tile_k(x.dtype),
                       FP8=fp8, PRECISION=precision, UPCAST=upcast)
    return out


def _check_gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> None:
    check_same_device(x=x, weight=weight, scale=scale)
    if weight.dtype not in WEIGHT_DTYPES:
        raise ValueError(f"weight is {weight.dtype}; expected int8 or float8_e4m3fn")
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} and weight {tuple(weight.shape)} must be [M, K] "
                         "and [N, K]")
    if scale.numel() != weight.shape[0] or scale.dtype != torch.float32:
        raise ValueError(f"scale must be fp32 with one value per output row ({weight.shape[0]});"
                         f" got {scale.dtype} {tuple(scale.shape)}")
    if x.stride(1) != 1 or not weight.is_contiguous() or not scale.is_contiguous():
        raise ValueError("x's rows, weight and scale must be contiguous")
