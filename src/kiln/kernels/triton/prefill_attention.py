"""Paged prefill/extend attention: each sequence's chunk of query tokens over its cached prefix
and itself, causal, or by kiln's draft-tree bit masks (speculative verification).

Reference: reference.paged_prefill_attention. The flat batch is kiln's (SeqLayout): sequence
s owns query rows query_start[s] .. + query_lens[s], sits after context_lens[s] cached tokens,
and its keys (prefix and chunk, the chunk already written by kv_cache.write_kv) are read in
place through its block-table row. A token with nonzero tree_mask bits m sees every context
key and the chunk's token j where bit j of m is set; 0 is causal.
"""

from __future__ import annotations

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
from kiln.kernels.triton.decode_attention import LOG2E
from kiln.kernels.triton.tiles import attention_tiles, dot, dot_mode, paged_kv_offsets


@triton.jit
def _visible(pos, q_pos, bits, context_len, HAS_TREE: tl.constexpr):
    """[M, N] which keys at positions `pos` [N] the queries at `q_pos` [M] may attend."""
    causal = pos[None, :] <= q_pos[:, None]
    if HAS_TREE:
        rel = (pos - context_len).to(tl.int64)  # the key's index in the chunk (< 0: context)
        in_chunk = (rel >= 0) & (rel < 63)
        bit = ((bits[:, None] >> tl.minimum(tl.maximum(rel, 0), 62)[None, :]) & 1) != 0
        tree = tl.where(in_chunk[None, :], bit, (rel < 0)[None, :])
        causal = tl.where((bits != 0)[:, None], tree, causal)
    return causal


@triton.jit
def _prefill_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, query_start_ptr,
                    query_lens_ptr, context_lens_ptr, tree_ptr, out_ptr,
                    stride_qt, stride_qh, stride_cs, stride_ch, stride_bt, stride_ot, stride_oh,
                    qk_scale, block_size,
                    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HAS_TREE: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                    PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    # program (sequence, kv head, tile of BLOCK_M rows); online softmax over keys. A row is a
    # (query token, query head of the kv head's group) pair, token-major: the group shares
    # each K/V tile it loads, and a short query (decode, a draft tree) fills GROUP rows a token
    seq, kv_head, tile = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    query_len = tl.load(query_lens_ptr + seq).to(tl.int32)
    if tile * BLOCK_M < query_len * GROUP:
        first_row = tl.load(query_start_ptr + seq).to(tl.int64)
        context_len = tl.load(context_lens_ptr + seq).to(tl.int32)
        pair = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        idx = pair // GROUP  # the token's index in the chunk
        head = kv_head * GROUP + pair % GROUP
        row_mask = idx < query_len
        rows = first_row + idx
        d = tl.arange(0, BLOCK_D)
        qd_mask = row_mask[:, None] & (d < HEAD_DIM)[None, :]
        q_offs = rows[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
        q = tl.load(q_ptr + q_offs, mask=qd_mask, other=0.0)
        q_pos = context_len + idx
        if HAS_TREE:  # a tree row may see any chunk token its bits name
            bits = tl.load(tree_ptr + rows, mask=row_mask, other=0).to(tl.int64)
            end = context_len + query_len
        else:
            bits = tl.zeros([BLOCK_M], tl.int64)
            last_token = ((tile + 1) * BLOCK_M - 1) // GROUP
            end = context_len + tl.minimum(query_len, last_token + 1)
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        denom = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for pos0 in range(0, end, BLOCK_N):
            pos = pos0 + tl.arange(0, BLOCK_N)
            key_mask = pos < end
            kv_offs, kv_mask = paged_kv_offsets(block_table_ptr, seq, stride_bt, pos, key_mask,
                                                 block_size, kv_head, stride_cs, stride_ch, d,
                                                 HEAD_DIM)
            k = tl.load(k_cache_ptr + kv_offs, mask=kv_mask, other=0.0)
            s = dot(q, tl.trans(k), PRECISION, UPCAST) * qk_scale
            visible = _visible(pos, q_pos, bits, context_len, HAS_TREE) & key_mask[None, :]
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row seeing nothing yet
            p = tl.exp2(s - m_safe[:, None])
            alpha = tl.exp2(m - m_safe)
            denom = denom * alpha + tl.sum(p, 1)
            v = tl.load(v_cache_ptr + kv_offs, mask=kv_mask, other=0.0)
            acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, PRECISION, UPCAST)
            m = m_new
        acc = acc / tl.where(denom > 0, denom, 1.0)[:, None]
        o_offs = rows[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
        tl.store(out_ptr + o_offs, acc.to(out_ptr.dtype.element_ty), mask=qd_mask)


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_table: torch.Tensor, query_start: torch.Tensor,
                            query_lens: torch.Tensor, context_lens: torch.Tensor,
                            block_size: int, scale: float, max_query_len: int,
                            tree_mask: torch.Tensor | None = None,
                            out: torch.Tensor | None = None) -> torch.Tensor:
    """Each sequence's query chunk over its cached prefix and itself -> [T, Hq, D].

    q [T, Hq, D] (the flat batch, last dim contiguous); k_cache/v_cache [num_slots, Hkv, D],
    Hq a multiple of Hkv; block_table [S, max_blocks], query_start, query_lens and
    context_lens [S] (int32/int64, on q's device: kiln's SeqLayout fields). max_query_len: an
    upper bound of query_lens (a host int, so no device sync; it sizes the grid). tree_mask:
    [T] int64 draft-tree bits or None (all causal). Rows of q that belong to no sequence are
    left unwritten. `out`: an [T, Hq, D] tensor to write into, returned.
    """
    group = _check_prefill(q, k_cache, v_cache, block_table, query_start, query_lens,
                           context_lens, tree_mask)
    out = check_out(out, q.shape, q.dtype, q.device)
    num_seqs, head_dim = len(query_lens), q.shape[2]
    if num_seqs == 0 or max_query_len == 0:
        return out
    tiles = attention_tiles(q.dtype, head_dim)
    precision, upcast = dot_mode(q.dtype)
    grid = (num_seqs, k_cache.shape[1], triton.cdiv(max_query_len * group, tiles.block_m))
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_table, query_start, query_lens, context_lens,
        query_lens if tree_mask is None else tree_mask, out,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), block_table.stride(0),
        out.stride(0), out.stride(1), scale * LOG2E, block_size,
        GROUP=group, HEAD_DIM=head_dim, HAS_TREE=tree_mask is not None, BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n, BLOCK_D=triton.next_power_of_2(head_dim),
        PRECISION=precision, UPCAST=upcast, num_warps=tiles.num_warps)
    return out


def _check_prefill(q, k_cache, v_cache, block_table, query_start, query_lens, context_lens,
                   tree_mask) -> int:
    check_same_device(q=q, k_cache=k_cache, v_cache=v_cache, block_table=block_table,
                      query_start=query_start, query_lens=query_lens, context_lens=context_lens)
    check_cache(k_cache, v_cache)
    group = check_heads(q, k_cache)
    check_index("block_table", block_table, 2)
    for name, t in (("query_start", query_start), ("query_lens", query_lens),
                    ("context_lens", context_lens)):
        check_index(name, t, 1)
        if len(t) != block_table.shape[0]:
            raise ValueError(f"{name} has {len(t)} entries; block_table has "
                             f"{block_table.shape[0]} sequences")
    if tree_mask is not None and (tree_mask.dtype != torch.int64
                                  or tree_mask.shape != (q.shape[0],)
                                  or tree_mask.device != q.device):
        raise ValueError(f"tree_mask must be int64 [{q.shape[0]}] on {q.device}; got "
                         f"{tree_mask.dtype} {tuple(tree_mask.shape)} on {tree_mask.device}")
    return group
