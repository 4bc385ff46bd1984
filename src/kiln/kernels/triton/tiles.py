"""Tile helpers shared by the kernels."""

from __future__ import annotations

from dataclasses import dataclass

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


@triton.jit
def paged_kv_offsets(block_table_ptr, seq, stride_bt, pos, key_mask, block_size, kv_head,
                     stride_cs, stride_ch, d, HEAD_DIM: tl.constexpr):
    """Offsets into a K/V cache [slots, kv heads, head dim] of sequence `seq`'s positions
    `pos` for head `kv_head` (slot = block_table[seq, pos // block_size] * block_size +
    pos % block_size), and their mask (keys in `key_mask`, dims below HEAD_DIM)."""
    block = tl.load(block_table_ptr + seq.to(tl.int64) * stride_bt + pos // block_size,
                    mask=key_mask, other=0)
    slot = block.to(tl.int64) * block_size + pos % block_size
    offsets = slot[:, None] * stride_cs + kv_head * stride_ch + d[None, :]
    return offsets, key_mask[:, None] & (d < HEAD_DIM)[None, :]


@dataclass(frozen=True)
class AttentionTiles:
    """Tile sizes and warps of the attention kernels for one dtype and head dim."""

    block_m: int  # query rows per prefill program (tl.dot needs >= 16)
    block_n: int  # keys per loop step
    num_warps: int


def attention_tiles(dtype: torch.dtype, head_dim: int) -> AttentionTiles:
    """Under the interpreter, 16 (tiny test shapes still cross tile and block boundaries).
    On a GPU, chosen by compiling for sm_90 with Triton 3.7.1 and 3.9
    (tests/kernels/triton/gpu_compile.py) to keep registers from spilling: 16-bit inputs 64
    query rows on 8 warps, keys 64 a step (32 past head dim 64); fp32 (a parity mode: IEEE dot
    products run without tensor cores) 32 x 32 on 8 warps."""
    if INTERPRETED:
        return AttentionTiles(16, 16, 4)
    if dtype == torch.float32:
        return AttentionTiles(32, 32, 8)
    return AttentionTiles(64, 32 if head_dim > 64 else 64, 8)
