"""RMSNorm (optionally fused with the residual add before it) and in-place rotary embedding.

References: reference.rms_norm, reference.fused_add_rms_norm and reference.rotary, which are
kiln's TorchOps semantics (HF Llama's): normalize in fp32, round to the activation dtype, then
scale by the weight; rotate-half (neox) rotary from [max_pos, D] cos/sin tables, computed in
fp32 and rounded once (as kiln's C++ kernel does with its fp32 tables).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.kernels.triton.checks import check_index, check_same_device


@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, stride_x, stride_r, stride_o,
                     eps, HIDDEN: tl.constexpr, BLOCK: tl.constexpr,
                     HAS_RESIDUAL: tl.constexpr):
    # one program per row; with a residual, residual <- residual + x, then normalize that
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < HIDDEN
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x.dtype)
        tl.store(residual_ptr + row * stride_r + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x32 * x32, 0) / HIDDEN + eps)
    normed = (x32 * rstd).to(x.dtype).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (weight * normed).to(out_ptr.dtype.element_ty),
             mask=mask)


def _check_rows(x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dim() != 2 or weight.shape != (x.shape[1],):
        raise ValueError(f"x must be [T, H] and weight [H]; got x {tuple(x.shape)}, weight "
                         f"{tuple(weight.shape)}")
    if x.stride(1) != 1 or not weight.is_contiguous():
        raise ValueError("x's rows and weight must be contiguous")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x [T, H] (rows contiguous) by weight [H] -> new [T, H] in x's dtype."""
    check_same_device(x=x, weight=weight)
    _check_rows(x, weight)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.shape[0]:
        _rms_norm_kernel[(x.shape[0],)](x, x, weight, out, x.stride(0), 0, out.stride(0), eps,
                                        HIDDEN=x.shape[1], BLOCK=triton.next_power_of_2(x.shape[1]),
                                        HAS_RESIDUAL=False)
    return out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """residual += x (in place, rounded to the dtype), then RMSNorm of it: returns
    (normed [T, H] new, residual). x and residual [T, H] of one dtype, rows contiguous."""
    check_same_device(x=x, residual=residual, weight=weight)
    _check_rows(x, weight)
    if residual.shape != x.shape or residual.dtype != x.dtype or residual.stride(1) != 1:
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} must match x "
                         f"{tuple(x.shape)} {x.dtype} with contiguous rows")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.shape[0]:
        _rms_norm_kernel[(x.shape[0],)](x, residual, weight, out, x.stride(0),
                                        residual.stride(0), out.stride(0), eps,
                                        HIDDEN=x.shape[1], BLOCK=triton.next_power_of_2(x.shape[1]),
                                        HAS_RESIDUAL=True)
    return out, residual


@triton.jit
def _rotary_kernel(qkv_ptr, positions_ptr, cos_ptr, sin_ptr, stride_t, stride_p,
                   ROTATED_HEADS: tl.constexpr, HALF: tl.constexpr,
                   BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    # one program per token: its q and k heads [BLOCK_H, 2 halves of BLOCK_HALF]
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None]
    i = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (h < ROTATED_HEADS) & (i < HALF)
    first = qkv_ptr + token * stride_t + h * (2 * HALF) + i
    x1 = tl.load(first, mask=mask, other=0.0)
    x2 = tl.load(first + HALF, mask=mask, other=0.0)
    table = pos * stride_p + i
    cos1 = tl.load(cos_ptr + table, mask=i < HALF, other=0.0).to(tl.float32)
    cos2 = tl.load(cos_ptr + table + HALF, mask=i < HALF, other=0.0).to(tl.float32)
    sin1 = tl.load(sin_ptr + table, mask=i < HALF, other=0.0).to(tl.float32)
    sin2 = tl.load(sin_ptr + table + HALF, mask=i < HALF, other=0.0).to(tl.float32)
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    tl.store(first, (a * cos1 - b * sin1).to(x1.dtype), mask=mask)
    tl.store(first + HALF, (b * cos2 + a * sin2).to(x1.dtype), mask=mask)


def rotary_inplace(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, num_q_heads: int, num_kv_heads: int) -> None:
    """Rotate the q and k heads inside the fused projection output qkv [T, (Hq + 2 Hkv) * D]
    (rows contiguous, any row stride) in place; v is untouched.

    positions [T] int32/int64; cos/sin [max_pos, D] (kiln's RotaryEmbedding.cos32/sin32:
    fp32 tables give one rounding). Every position must be < max_pos (not checked: a read of
    device memory).
    """
    check_same_device(qkv=qkv, positions=positions, cos=cos, sin=sin)
    check_index("positions", positions, 1)
    head_dim = cos.shape[-1]
    if (qkv.dim() != 2 or qkv.shape[1] != (num_q_heads + 2 * num_kv_heads) * head_dim
            or positions.shape != (qkv.shape[0],) or head_dim % 2):
        raise ValueError(f"qkv {tuple(qkv.shape)} must be [T, ({num_q_heads} + 2 * "
                         f"{num_kv_heads}) * {head_dim}] with positions [T] (got "
                         f"{tuple(positions.shape)}) and an even head_dim")
    if qkv.stride(1) != 1 or sin.shape != cos.shape or not (cos.is_contiguous()
                                                           and sin.is_contiguous()):
        raise ValueError("qkv's rows and the cos/sin tables (of one shape) must be contiguous")
    if qkv.shape[0] == 0:
        return
    heads = num_q_heads + num_kv_heads
    _rotary_kernel[(qkv.shape[0],)](
        qkv, positions, cos, sin, qkv.stride(0), cos.stride(0), ROTATED_HEADS=heads,
        HALF=head_dim // 2, BLOCK_H=triton.next_power_of_2(heads),
        BLOCK_HALF=triton.next_power_of_2(head_dim // 2))
