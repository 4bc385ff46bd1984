"""The torch definitions the Triton kernels of this package must match (plain, slow, clear).

Layouts are kiln's (kiln.runner.attention): one layer's KV cache is two tensors
[num_slots, num_kv_heads, head_dim] with slot = block_id * block_size + offset; a sequence's
block table row lists its blocks in order (padded with any id); the flat batch puts each
sequence's query tokens at query_start .. query_start + query_len. Attention math runs in fp32
and rounds once to the query's dtype. tests/kernels/triton/ holds each kernel to these, and
these to kiln's own torch paths (TorchPagedAttention, TorchOps, the int8/fp8 dequantizing
reference).
"""

from __future__ import annotations

import torch


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k/v [T, Hkv, D] into k_cache/v_cache [num_slots, Hkv, D] at rows slot_mapping [T]."""
    k_cache.index_copy_(0, slot_mapping, k)
    v_cache.index_copy_(0, slot_mapping, v)


def key_slots(block_row: torch.Tensor, seq_len: int, block_size: int) -> torch.Tensor:
    """[seq_len] cache slots of a sequence's keys, in position order."""
    pos = torch.arange(seq_len, device=block_row.device)
    return block_row[pos // block_size].long() * block_size + pos % block_size


def tree_visibility(bits: torch.Tensor, context_len: int, seq_len: int) -> torch.Tensor:
    """[n, seq_len] bool: which keys each of a sequence's n query tokens may attend.

    bits [n] int64 (kiln.models.layers.attention.SeqLayout.tree_mask): 0 is causal (keys at
    positions <= the token's own); a nonzero m sees every context key and the query tokens j
    of its own sequence with bit j of m set (a draft tree: its ancestors and itself).
    """
    n = len(bits)
    key_pos = torch.arange(seq_len, device=bits.device)
    causal = key_pos[None, :] <= context_len + torch.arange(n, device=bits.device)[:, None]
    rel = key_pos - context_len  # the key's index among the query tokens, < 0 for context
    in_block = (rel >= 0) & (rel < 63)
    tree_bits = ((bits[:, None] >> rel.clamp(0, 62)[None, :]) & 1).bool()
    tree = torch.where(in_block[None, :], tree_bits, (rel < 0)[None, :])
    return torch.where(bits[:, None] != 0, tree, causal)


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor,
            scale: float) -> torch.Tensor:
    """q [n, Hq, D] over keys/values [L, Hkv, D] where visible [n, L] -> fp32 [n, Hq, D]."""
    group = q.shape[1] // keys.shape[1]
    k = keys.float().repeat_interleave(group, dim=1)  # [L, Hq, D]
    v = values.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q.float(), k) * scale
    scores = scores.masked_fill(~visible[None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # rows that see no key: zeros
    return torch.einsum("hnl,lhd->nhd", probs, v)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_table: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
                           scale: float) -> torch.Tensor:
    """One query token per sequence: q [S, Hq, D] over each sequence's seq_lens[s] cached keys
    (the query's own included) -> [S, Hq, D]. A row with seq_len 0 gives zeros."""
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for s, seq_len in enumerate(seq_lens.tolist()):
        if seq_len == 0:
            continue
        slots = key_slots(block_table[s], seq_len, block_size)
        visible = torch.ones(1, seq_len, dtype=torch.bool, device=q.device)
        out[s] = _attend(q[s:s + 1], k_cache[slots], v_cache[slots], visible, scale)[0]
    return out.to(q.dtype)


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_table: torch.Tensor, query_start: torch.Tensor,
                            query_lens: torch.Tensor, context_lens: torch.Tensor,
                            block_size: int, scale: float,
                            tree_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Each sequence's query_lens[s] tokens (flat rows from query_start[s]) over its
    context_lens[s] + query_lens[s] cached keys, causal (or by `tree_visibility` where
    tree_mask [T] has bits) -> [T, Hq, D]. Rows of no sequence stay zero."""
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for s, (start, n, context) in enumerate(zip(query_start.tolist(), query_lens.tolist(),
                                               context_lens.tolist(), strict=True)):
        if n == 0:
            continue
        slots = key_slots(block_table[s], context + n, block_size)
        bits = (torch.zeros(n, dtype=torch.int64, device=q.device) if tree_mask is None
                else tree_mask[start:start + n])
        visible = tree_visibility(bits, context, context + n)
        out[start:start + n] = _attend(q[start:start + n], k_cache[slots], v_cache[slots],
                                       visible, scale)
    return out.to(q.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF Llama's RMSNorm: normalize in fp32, round to x's dtype, then scale by weight."""
    x32 = x.float()
    normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (weight.float() * normed.float()).to(x.dtype)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + x), residual + x), the sum rounded to x's dtype first."""
    summed = residual + x
    return rms_norm(summed, weight, eps), summed


def rotary(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
           num_q_heads: int, num_kv_heads: int) -> torch.Tensor:
    """The fused projection output qkv [T, (Hq + 2 Hkv) * D] with its q and k heads rotated
    (rotate-half / neox layout; cos/sin [max_pos, D] tables, fp32 math, one rounding)."""
    tokens, head_dim = qkv.shape[0], cos.shape[-1]
    rotated_heads = num_q_heads + num_kv_heads
    heads = qkv.view(tokens, -1, head_dim)[:, :rotated_heads].float()
    c = cos[positions].float()[:, None, :]
    s = sin[positions].float()[:, None, :]
    half = head_dim // 2
    rotate_half = torch.cat((-heads[..., half:], heads[..., :half]), dim=-1)
    out = qkv.clone().view(tokens, -1, head_dim)
    out[:, :rotated_heads] = (heads * c + rotate_half * s).to(qkv.dtype)
    return out.view(qkv.shape)


def weight_only_gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ (weight [N, K] int8 or float8_e4m3fn * scale [N, 1] fp32)^T -> [M, N] in
    x's dtype, accumulated in fp32."""
    w = weight.float() * scale.float().reshape(-1, 1)
    return (x.float() @ w.t()).to(x.dtype)
