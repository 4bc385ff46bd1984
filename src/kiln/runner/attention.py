"""Paged attention: the torch reference path, and the seam where faster kernels plug in.

The KV cache of one layer is two tensors of shape [num_slots, num_kv_heads, head_dim], where
slot = block_id * block_size + offset. Each step, every scheduled token's K and V are written
to its slot first (so a sequence that shares prefix blocks with another scheduled in the same
step reads them in the same layer), then each query token attends to the keys of its own
sequence at positions <= its own.

A model with multi-head latent attention (kiln.models.layers.mla) keeps one tensor per layer,
[num_slots, 1, R + P] (its latent and rope key), and calls `forward_latent`: multi-query
attention whose values are the first R columns of the keys. Both backends run it through the
torch path below (the C++ kernels take K and V of one width, from two contiguous tensors).

The reference backend pads the flat batch into [num_seqs, max_query_len] queries against
[num_seqs, max_seq_len] gathered keys with a boolean mask: correct for any mix of prefill
chunks, decodes and draft tokens, and a few large tensor ops per layer rather than a Python
loop over sequences. The metadata (index tensors and mask) is built once per step and shared
by all layers.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from kiln.models.layers.attention import AttentionBackend, SeqLayout
from kiln.runner.slots import slot_mapping_for

log = logging.getLogger(__name__)


@dataclass
class PaddedLayout:
    """Index tensors of the padded reference path over some sequences of the batch."""

    query_index: torch.Tensor  # [S, Qmax] flat index of each padded query (pads -> 0)
    key_slots: torch.Tensor  # [S, Kmax] cache slot of each key position (pads -> slot 0)
    mask: torch.Tensor  # [S, 1, Qmax, Kmax] True where the query may attend the key
    output_index: torch.Tensor  # row of each of their tokens in the [S * Qmax] padded output


@dataclass
class TorchAttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot of each flat token
    padded: PaddedLayout


_BACKENDS: dict[str, Callable[[], AttentionBackend]] = {}


def register_attention_backend(name: str):
    def wrap(cls):
        _BACKENDS[name] = cls
        return cls
    return wrap


def get_attention_backend(name: str) -> AttentionBackend:
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; known: {', '.join(_BACKENDS)}")
    return _BACKENDS[name]()


def build_padded_layout(layout: SeqLayout, block_size: int) -> PaddedLayout:
    """Index tensors and mask for the padded reference path over the sequences in `layout`."""
    num_seqs, device = len(layout.query_lens), layout.query_lens.device
    q_max = int(layout.query_lens.max())
    k_max = int(layout.seq_lens.max())
    q_off = torch.arange(q_max, device=device)
    q_valid = q_off[None, :] < layout.query_lens[:, None]  # [S, Qmax]
    query_index = torch.where(q_valid, layout.query_start[:, None] + q_off, 0)
    q_pos = torch.where(q_valid, layout.context_lens[:, None] + q_off, 0)  # pads see key 0
    k_pos = torch.arange(k_max, device=device)
    mask = k_pos[None, None, :] <= q_pos[:, :, None]  # [S, Qmax, Kmax]
    if layout.tree_mask is not None:
        mask = _tree_visibility(layout, query_index, q_valid, k_pos, mask)
    mask = mask.unsqueeze(1)  # [S, 1, Qmax, Kmax]
    k_blocks = layout.block_table[:, (k_pos // block_size).clamp(
        max=layout.block_table.shape[1] - 1)]
    key_slots = k_blocks * block_size + k_pos % block_size
    key_slots = torch.where(k_pos[None, :] < layout.seq_lens[:, None], key_slots, 0)
    output_index = (torch.arange(num_seqs, device=device)[:, None] * q_max + q_off)[q_valid]
    return PaddedLayout(query_index, key_slots, mask, output_index)


def _tree_visibility(layout: SeqLayout, query_index: torch.Tensor, q_valid: torch.Tensor,
                     k_pos: torch.Tensor, causal: torch.Tensor) -> torch.Tensor:
    """The [S, Qmax, Kmax] mask with tree tokens' rows replaced: every context key, and the
    query tokens of their own sequence whose bits they carry."""
    bits = torch.where(q_valid, layout.tree_mask[query_index], 0)  # [S, Qmax]
    rel = k_pos[None, :] - layout.context_lens[:, None]  # [S, Kmax] key's index in the block
    in_block = (rel >= 0) & (rel < 63)
    shifted = bits[:, :, None] >> rel.clamp(0, 62)[:, None, :]
    tree = torch.where(in_block[:, None, :], (shifted & 1).bool(), (rel < 0)[:, None, :])
    return torch.where(bits[:, :, None] != 0, tree, causal)


def padded_attention(q, kv_cache, meta: PaddedLayout, scale: float) -> torch.Tensor:
    """SDPA over gathered keys; returns [tokens of meta's sequences, Hq * D] in flat order."""
    k_cache, v_cache = kv_cache
    qp = q[meta.query_index].transpose(1, 2)  # [S, Hq, Qmax, D]
    kp = k_cache[meta.key_slots].transpose(1, 2)  # [S, Hkv, Kmax, D]
    vp = v_cache[meta.key_slots].transpose(1, 2)
    out = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=meta.mask, scale=scale,
                                         enable_gqa=qp.shape[1] != kp.shape[1])
    num_seqs, heads, q_max, head_dim = out.shape
    out = out.transpose(1, 2).reshape(num_seqs * q_max, heads * head_dim)
    return out[meta.output_index]


@register_attention_backend("torch")
class TorchPagedAttention:
    """Reference paged attention in plain torch (SDPA over gathered, padded keys)."""

    def build_metadata(self, layout: SeqLayout, positions: torch.Tensor, block_size: int,
                       slot_mapping: torch.Tensor | None = None) -> TorchAttentionMetadata:
        if slot_mapping is None:
            slot_mapping = slot_mapping_for(layout, positions, block_size)
        return TorchAttentionMetadata(slot_mapping, build_padded_layout(layout, block_size))

    def forward(self, q, k, v, kv_cache, meta: TorchAttentionMetadata, scale: float):
        k_cache, v_cache = kv_cache
        k_cache.index_copy_(0, meta.slot_mapping, k)
        v_cache.index_copy_(0, meta.slot_mapping, v)
        return padded_attention(q, kv_cache, meta.padded, scale)

    def forward_latent(self, q, kv, kv_cache, meta: TorchAttentionMetadata, scale: float,
                       value_dim: int):
        cache = _write_latent(kv, kv_cache, meta.slot_mapping)
        return padded_latent_attention(q, cache, meta.padded, scale, value_dim)


def _write_latent(kv: torch.Tensor, kv_cache: tuple[torch.Tensor],
                  slot_mapping: torch.Tensor) -> torch.Tensor:
    """Write an MLA layer's [T, 1, R + P] rows to its one cache tensor; returns that tensor."""
    (cache,) = kv_cache
    cache.index_copy_(0, slot_mapping, kv)
    return cache


def padded_latent_attention(q: torch.Tensor, cache: torch.Tensor, meta: PaddedLayout,
                            scale: float, value_dim: int) -> torch.Tensor:
    """MLA's attention over its one shared head: q [T, H, R + P] against the gathered rows of
    `cache` as keys and their first `value_dim` columns as values -> [tokens of meta's
    sequences, H * value_dim] in flat order. Each (query, head) pair is a query row of that
    one head, so keys are gathered once, not repeated per head as GQA's SDPA would."""
    heads = q.shape[1]
    qp = q[meta.query_index]  # [S, Qmax, H, R + P]
    num_seqs, q_max = qp.shape[:2]
    qp = qp.reshape(num_seqs, 1, q_max * heads, -1)  # row i * H + h: query i, head h
    kp = cache[meta.key_slots].transpose(1, 2)  # [S, 1, Kmax, R + P]
    mask = meta.mask.repeat_interleave(heads, dim=2)  # [S, 1, Qmax * H, Kmax]
    out = F.scaled_dot_product_attention(qp, kp, kp[..., :value_dim], attn_mask=mask,
                                         scale=scale)  # [S, 1, Qmax * H, R]
    return out.reshape(num_seqs * q_max, heads * value_dim)[meta.output_index]


@dataclass
class LongQuery:
    """One long prefill chunk: its flat rows start..start+n, attending keys at `key_slots`
    (its whole sequence so far) with a causal mask aligned to the end (bottom right)."""

    start: int
    n: int
    key_slots: torch.Tensor  # [context + n] cache slots of the sequence's keys, in order


@dataclass
class CpuAttentionMetadata:
    slot_mapping: torch.Tensor  # [T]
    block_size: int
    short: SeqLayout | None  # sequences with short queries: the C++ kernel reads the cache
    long: SeqLayout | None  # sequences with long prefill chunks
    num_tokens: int
    long_chunks: list[LongQuery] | None = None  # `long` one chunk at a time, for SDPA
    short_padded: PaddedLayout | None = None  # `short` for the torch path (MLA layers)

    def long_queries(self) -> list[LongQuery]:
        if self.long_chunks is None:  # built once per step, shared by every layer
            self.long_chunks = long_queries(self.long, self.block_size)
        return self.long_chunks

    def short_padded_layout(self) -> PaddedLayout:
        if self.short_padded is None:  # built once per step, shared by every layer
            self.short_padded = build_padded_layout(self.short, self.block_size)
        return self.short_padded


def long_queries(layout: SeqLayout, block_size: int) -> list[LongQuery]:
    out = []
    for start, n, context, blocks in zip(layout.query_start.tolist(), layout.query_lens.tolist(),
                                         layout.context_lens.tolist(), layout.block_table,
                                         strict=True):
        pos = torch.arange(context + n, device=blocks.device)
        out.append(LongQuery(start, n, blocks[pos // block_size] * block_size + pos % block_size))
    return out


def causal_attention(q: torch.Tensor, kv_cache, item: LongQuery, scale: float) -> torch.Tensor:
    """SDPA for one sequence's chunk: [n, Hq, D] queries over its cached keys -> [n, Hq * D].
    A causal bias instead of a materialized mask lets SDPA skip the masked blocks."""
    k_cache, v_cache = kv_cache
    qs = q[item.start:item.start + item.n].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
    ks = k_cache[item.key_slots].transpose(0, 1).unsqueeze(0)  # [1, Hkv, K, D]
    vs = v_cache[item.key_slots].transpose(0, 1).unsqueeze(0)
    gqa = qs.shape[1] != ks.shape[1]
    if ks.shape[2] == item.n:
        out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale,
                                             enable_gqa=gqa)
    else:
        out = F.scaled_dot_product_attention(qs, ks, vs, scale=scale, enable_gqa=gqa,
                                             attn_mask=causal_lower_right(item.n, ks.shape[2]))
    return out[0].transpose(0, 1).reshape(item.n, -1)


def _subset(layout: SeqLayout, keep: torch.Tensor) -> SeqLayout:
    return SeqLayout(layout.query_start[keep], layout.query_lens[keep],
                     layout.context_lens[keep], layout.block_table[keep], layout.tree_mask)


@register_attention_backend("cpu")
class CpuPagedAttention:
    """C++ paged attention for decodes and short queries (reads K/V in place, no gather).
    Long prefill chunks go to the C++ prefill kernel (bf16 with AVX512-BF16 dot products,
    head dim 64 or 128: ~3x torch's CPU flash attention here) and otherwise through SDPA one
    sequence at a time with a causal bias (the gather cost is amortized over many query tokens,
    and SDPA skips the masked half). Needs kiln.kernels.cpu."""

    max_kernel_query_len = 16

    def __init__(self):
        from kiln.kernels import cpu as cpu_kernels

        if not cpu_kernels.load():
            raise RuntimeError("the cpu attention backend needs the kiln CPU kernels")
        self.bf16_prefill = bool(torch.ops.kiln.has_bf16_attention())
        if not self.bf16_prefill:
            log.info("kiln CPU kernels built without AVX512-BF16: long prefill chunks use "
                     "torch's SDPA")

    def build_metadata(self, layout: SeqLayout, positions: torch.Tensor, block_size: int,
                       slot_mapping: torch.Tensor | None = None) -> CpuAttentionMetadata:
        short, long = self._split(layout)
        if slot_mapping is None:
            slot_mapping = slot_mapping_for(layout, positions, block_size)
        return CpuAttentionMetadata(slot_mapping, block_size, short, long, len(positions))

    def _split(self, layout: SeqLayout) -> tuple[SeqLayout | None, SeqLayout | None]:
        """(short, long) queries: the layout itself where every query is short (decode and
        verify steps: known from the builder's ints where it gave them, no device reads)."""
        if layout.tree_mask is None and layout.max_query_len is not None:
            if layout.max_query_len <= self.max_kernel_query_len:
                return layout, None
        is_short = layout.query_lens <= self.max_kernel_query_len
        if layout.tree_mask is not None:  # a draft tree (up to 32 tokens) needs its bits here
            is_short |= layout.tree_mask[layout.query_start + layout.query_lens - 1] != 0
        if bool(is_short.all()):
            return layout, None
        short = _subset(layout, is_short) if bool(is_short.any()) else None
        return short, _subset(layout, ~is_short)

    def forward(self, q, k, v, kv_cache, meta: CpuAttentionMetadata, scale: float):
        k_cache, v_cache = kv_cache
        torch.ops.kiln.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        heads, head_dim = q.shape[1], q.shape[2]
        out = torch.empty(meta.num_tokens, heads * head_dim, dtype=q.dtype, device=q.device)
        if meta.short is not None:
            s = meta.short
            torch.ops.kiln.paged_attention(out, q, k_cache, v_cache, s.block_table,
                                           s.query_start, s.query_lens, s.context_lens,
                                           meta.block_size, scale, s.tree_mask)
        if meta.long is None:
            return out
        if self.bf16_prefill and q.dtype == torch.bfloat16 and head_dim in (64, 128):
            s = meta.long
            torch.ops.kiln.prefill_attention(out, q, k_cache, v_cache, s.block_table,
                                             s.query_start, s.query_lens, s.context_lens,
                                             meta.block_size, scale)
        else:
            for item in meta.long_queries():
                out[item.start:item.start + item.n] = causal_attention(q, kv_cache, item, scale)
        return out

    def forward_latent(self, q, kv, kv_cache, meta: CpuAttentionMetadata, scale: float,
                       value_dim: int):
        """MLA through torch (the C++ kernels need K and V of one width): short queries
        padded as the reference backend does, long chunks one SDPA call each."""
        cache = _write_latent(kv, kv_cache, meta.slot_mapping)
        out = torch.empty(meta.num_tokens, q.shape[1] * value_dim, dtype=q.dtype,
                          device=q.device)
        if meta.short is not None:
            padded = meta.short_padded_layout()
            rows = padded.query_index.flatten()[padded.output_index]
            out[rows] = padded_latent_attention(q, cache, padded, scale, value_dim)
        keys_values = (cache, cache[..., :value_dim])
        for item in meta.long_queries() if meta.long is not None else ():
            out[item.start:item.start + item.n] = causal_attention(q, keys_values, item, scale)
        return out


@register_attention_backend("triton")
def _triton_backend() -> AttentionBackend:
    """kiln's Triton kernels on the GPU (kiln.runner.attention_triton), imported only when
    asked for: they need the triton package."""
    from kiln.runner.attention_triton import TritonPagedAttention

    return TritonPagedAttention()
