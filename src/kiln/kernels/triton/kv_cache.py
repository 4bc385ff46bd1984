"""Writing the step's K and V into the paged cache (reference: reference.write_kv)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.kernels.triton.checks import check_cache, check_same_device


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh, stride_cs, stride_ch,
                     NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    # one program per token: all its kv heads, [BLOCK_H, BLOCK_D] at once
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < NUM_HEADS) & (d < HEAD_DIM)
    cache_offs = slot * stride_cs + h * stride_ch + d
    k = tl.load(k_ptr + token.to(tl.int64) * stride_kt + h * stride_kh + d, mask=mask)
    tl.store(k_cache_ptr + cache_offs, k, mask=mask)
    v = tl.load(v_ptr + token.to(tl.int64) * stride_vt + h * stride_vh + d, mask=mask)
    tl.store(v_cache_ptr + cache_offs, v, mask=mask)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Copy k/v [T, Hkv, D] (any row stride, last dim contiguous) into k_cache/v_cache
    [num_slots, Hkv, D] (contiguous) at rows slot_mapping [T] (int32 or int64).

    Every slot must lie in [0, num_slots): a kernel cannot raise, so an out-of-range slot
    writes out of bounds (the caller builds slots from its own block tables). Mutates the
    caches in place; nothing is returned.
    """
    check_same_device(k=k, v=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
    check_cache(k_cache, v_cache)
    if k.shape != v.shape or k.shape[1:] != k_cache.shape[1:]:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must both be "
                         f"[T, {k_cache.shape[1]}, {k_cache.shape[2]}] to match the cache")
    if slot_mapping.shape != (k.shape[0],):
        raise ValueError(f"slot_mapping is {tuple(slot_mapping.shape)}; expected "
                         f"[{k.shape[0]}], one slot per token")
    if k.stride(2) != 1 or v.stride(2) != 1:
        raise ValueError("k and v need a contiguous last (head_dim) dimension")
    tokens, heads, head_dim = k.shape
    if tokens == 0:
        return
    _write_kv_kernel[(tokens,)](
        k, v, k_cache, v_cache, slot_mapping, k.stride(0), k.stride(1), v.stride(0),
        v.stride(1), k_cache.stride(0), k_cache.stride(1), NUM_HEADS=heads, HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(heads), BLOCK_D=triton.next_power_of_2(head_dim))
