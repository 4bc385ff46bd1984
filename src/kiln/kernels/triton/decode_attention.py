"""Paged decode attention over kiln's KV cache: one query token per sequence, GQA, split along
the sequence for long contexts and then reduced (flash-decoding).

Reference: reference.paged_decode_attention. The kernel reads K/V in place through the block
tables (slot = block * block_size + offset, any block size) and expects this step's K/V
already written (kv_cache.write_kv). Softmax runs in
fp32 with exp2 (scores pre-multiplied by log2 e); P is rounded to the cache dtype for the PV
product, as flash attention does. fp32 inputs use IEEE dot products (not TF32), so fp32 results
match the reference to ~1e-5 on a GPU too.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kiln.kernels.triton.checks import (
    check_cache,
    check_heads,
    check_index,
    check_out,
    check_same_device,
)
from kiln.kernels.triton.tiles import attention_tiles, dot, dot_mode, paged_kv_offsets

LOG2E = 1.4426950408889634


@triton.jit
def _decode_split_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, seq_lens_ptr,
                         part_out_ptr, part_lse_ptr, out_ptr,
                         stride_qs, stride_qh, stride_cs, stride_ch, stride_bt,
                         stride_os, stride_oh, qk_scale, block_size,
                         GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
                         BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                         PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    # program (sequence, kv head, split): the GROUP query heads sharing the kv head, over
    # one contiguous range of the sequence's keys. NUM_SPLITS == 1 writes the final output;
    # otherwise the normalized partial output and its log2-sum-exp go to the workspace.
    seq, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    keys_per_split = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * keys_per_split
    end = tl.minimum(start + keys_per_split, seq_len)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + g
    gd_mask = (g < GROUP)[:, None] & (d < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + seq.to(tl.int64) * stride_qs + heads[:, None] * stride_qh + d[None, :],
                mask=gd_mask, other=0.0)
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for pos0 in range(start, end, BLOCK_N):
        pos = pos0 + tl.arange(0, BLOCK_N)
        key_mask = pos < end
        kv_offs, kv_mask = paged_kv_offsets(block_table_ptr, seq, stride_bt, pos, key_mask,
                                             block_size, kv_head, stride_cs, stride_ch, d,
                                             HEAD_DIM)
        k = tl.load(k_cache_ptr + kv_offs, mask=kv_mask, other=0.0)
        s = dot(q, tl.trans(k), PRECISION, UPCAST) * qk_scale
        s = tl.where(key_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))  # finite: every tile holds a key
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m - m_new)
        denom = denom * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + kv_offs, mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, PRECISION, UPCAST)
        m = m_new
    has_keys = denom > 0
    acc = acc / tl.where(has_keys, denom, 1.0)[:, None]  # a split with no keys: zeros
    if NUM_SPLITS == 1:
        o_offs = seq.to(tl.int64) * stride_os + heads[:, None] * stride_oh + d[None, :]
        tl.store(out_ptr + o_offs, acc.to(out_ptr.dtype.element_ty), mask=gd_mask)
    else:
        row = (seq.to(tl.int64) * GROUP * tl.num_programs(1) + heads) * NUM_SPLITS + split
        tl.store(part_out_ptr + row[:, None] * HEAD_DIM + d[None, :], acc, mask=gd_mask)
        lse = tl.where(has_keys, m + tl.log2(tl.where(has_keys, denom, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + row, lse, mask=g < GROUP)


@triton.jit
def _decode_reduce_kernel(part_out_ptr, part_lse_ptr, out_ptr, stride_os, stride_oh,
                          HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
                          BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    # program (sequence, query head): weight each split by 2^(lse - max lse)
    seq, head = tl.program_id(0), tl.program_id(1)
    row0 = (seq.to(tl.int64) * tl.num_programs(1) + head) * NUM_SPLITS
    sp = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    lse = tl.load(part_lse_ptr + row0 + sp, mask=sp < NUM_SPLITS, other=float("-inf"))
    top = tl.max(lse, 0)
    top = tl.where(top == float("-inf"), 0.0, top)  # no split saw a key: all weights 0
    weight = tl.exp2(lse - top)
    part_mask = (sp < NUM_SPLITS)[:, None] & (d < HEAD_DIM)[None, :]
    parts = tl.load(part_out_ptr + (row0 + sp)[:, None] * HEAD_DIM + d[None, :], mask=part_mask,
                    other=0.0)
    total = tl.sum(weight, 0)
    out = tl.sum(parts * weight[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + seq.to(tl.int64) * stride_os + head * stride_oh + d,
             out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def choose_num_splits(max_seq_len: int, num_seqs: int, num_kv_heads: int,
                      num_sms: int = 132, min_keys_per_split: int = 256) -> int:
    """A split count for `paged_decode_attention`: enough programs to fill ~2 waves of
    `num_sms` streaming multiprocessors (132 on an H100 SXM), each split at least
    `min_keys_per_split` keys, at most 64 splits. Fixed per CUDA graph (the split bounds are
    computed in the kernel from each sequence's length)."""
    programs = max(1, num_seqs * num_kv_heads)
    by_occupancy = math.ceil(2 * num_sms / programs)
    by_length = max(1, max_seq_len // min_keys_per_split)
    return max(1, min(by_occupancy, by_length, 64))


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_table: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
                           scale: float, num_splits: int = 1,
                           out: torch.Tensor | None = None) -> torch.Tensor:
    """One query token per sequence over its paged keys -> [S, Hq, D] in q's dtype.

    q [S, Hq, D] (last dim contiguous); k_cache/v_cache [num_slots, Hkv, D] with Hq a multiple
    of Hkv (GQA); block_table [S, max_blocks] and seq_lens [S] int32/int64 on q's device:
    sequence s attends its first seq_lens[s] keys (its own, already written, included). A
    row with seq_len 0 (a padded batch row) gives zeros. num_splits > 1 splits each
    sequence's keys into that many ranges run in parallel and then combined (flash-decoding;
    `choose_num_splits`); it needs an fp32 workspace of S * Hq * num_splits * (D + 1). `out`:
    an [S, Hq, D] tensor to write into (a CUDA graph's static buffer), returned.
    """
    group = _check_decode(q, k_cache, v_cache, block_table, seq_lens, num_splits)
    num_seqs, num_heads, head_dim = q.shape
    out = check_out(out, q.shape, q.dtype, q.device)
    if num_seqs == 0:
        return out
    splits = num_splits
    part_out = part_lse = out  # unused unless split
    if splits > 1:
        part_out = torch.empty(num_seqs, num_heads, splits, head_dim, dtype=torch.float32,
                               device=q.device)
        part_lse = torch.empty(num_seqs, num_heads, splits, dtype=torch.float32, device=q.device)
    block_d = triton.next_power_of_2(head_dim)
    precision, upcast = dot_mode(q.dtype)
    tiles = attention_tiles(q.dtype, head_dim)
    _decode_split_kernel[(num_seqs, k_cache.shape[1], splits)](
        q, k_cache, v_cache, block_table, seq_lens, part_out, part_lse, out,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), block_table.stride(0),
        out.stride(0), out.stride(1), scale * LOG2E, block_size,
        GROUP=group, HEAD_DIM=head_dim, NUM_SPLITS=splits,
        BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_D=block_d, BLOCK_N=tiles.block_n,
        PRECISION=precision, UPCAST=upcast, num_warps=tiles.num_warps)
    if splits > 1:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            part_out, part_lse, out, out.stride(0), out.stride(1), HEAD_DIM=head_dim,
            NUM_SPLITS=splits, BLOCK_S=triton.next_power_of_2(splits), BLOCK_D=block_d)
    return out


def _check_decode(q, k_cache, v_cache, block_table, seq_lens, num_splits) -> int:
    check_same_device(q=q, k_cache=k_cache, v_cache=v_cache, block_table=block_table,
                      seq_lens=seq_lens)
    check_cache(k_cache, v_cache)
    group = check_heads(q, k_cache)
    check_index("block_table", block_table, 2)
    check_index("seq_lens", seq_lens, 1)
    if len(seq_lens) != q.shape[0] or block_table.shape[0] != q.shape[0]:
        raise ValueError(f"q has {q.shape[0]} sequences but seq_lens has {len(seq_lens)} and "
                         f"block_table {block_table.shape[0]} rows")
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1; got {num_splits}")
    return group
