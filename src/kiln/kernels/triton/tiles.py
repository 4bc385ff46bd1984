"""Tile helpers shared by the kernels."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.kernels.triton import INTERPRETED


def dot_mode(dtype: torch.dtype) -> tuple[str, bool]:
    """(input_precision, upcast) for `dot` on operands of `dtype`.

    IEEE for fp32: TF32 would miss the fp32 reference by ~1e-3. Upcast: Triton 3.9's
    interpreter multiplies bf16 tiles wrongly (it reads their bits as other numbers), so under
    the interpreter bf16 operands are widened to fp32 first; compiled kernels keep bf16 tensor
    core dot products.
    """
    precision = "ieee" if dtype == torch.float32 else "tf32"  # tf32 ignored for 16-bit
    return precision, INTERPRETED and dtype == torch.bfloat16


@triton.jit
def dot(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """tl.dot(a, b) with fp32 accumulation (see dot_mode)."""
    if UPCAST:
        result = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        result = tl.dot(a, b, input_precision=PRECISION)
    return result
