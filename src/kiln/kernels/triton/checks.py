"""Argument checks shared by the entry functions: shapes, dtypes and devices only (nothing
that reads a tensor's values, which would synchronize with the GPU)."""

from __future__ import annotations

import torch

INDEX_DTYPES = (torch.int32, torch.int64)


def check_same_device(**tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        listed = ", ".join(f"{name} on {device}" for name, device in devices.items())
        raise ValueError(f"tensors must share one device; got {listed}")


def check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """Both [num_slots, Hkv, D], equal, contiguous, of one dtype."""
    if k_cache.dim() != 3 or k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} "
                         "must both be [num_slots, num_kv_heads, head_dim]")
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache is {k_cache.dtype} but v_cache is {v_cache.dtype}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")


def check_index(name: str, t: torch.Tensor, dims: int) -> None:
    if t.dtype not in INDEX_DTYPES or t.dim() != dims:
        raise ValueError(f"{name} must be a {dims}-d int32/int64 tensor; got {t.dim()}-d "
                         f"{t.dtype}")


def check_heads(q: torch.Tensor, k_cache: torch.Tensor) -> int:
    """q [N, Hq, D] against the cache's [*, Hkv, D]: returns the GQA group size Hq / Hkv."""
    if q.dim() != 3 or q.shape[2] != k_cache.shape[2]:
        raise ValueError(f"q is {tuple(q.shape)}; expected [N, num_q_heads, "
                         f"{k_cache.shape[2]}] (the cache's head_dim)")
    if q.shape[1] % k_cache.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of "
                         f"{k_cache.shape[1]} kv heads")
    if q.dtype != k_cache.dtype:
        raise ValueError(f"q is {q.dtype} but the cache is {k_cache.dtype}")
    if q.stride(2) != 1:
        raise ValueError("q needs a contiguous last (head_dim) dimension")
    return q.shape[1] // k_cache.shape[1]


def check_out(out: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype,
              device: torch.device) -> torch.Tensor:
    """The caller's output buffer (of this shape, dtype and device), or a new one."""
    shape = tuple(shape)
    if out is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if tuple(out.shape) != shape or out.dtype != dtype or out.device != device:
        raise ValueError(f"out is {tuple(out.shape)} {out.dtype} on {out.device}; expected "
                         f"{shape} {dtype} on {device}")
    if out.stride(-1) != 1:
        raise ValueError("out needs a contiguous last dimension")
    return out
