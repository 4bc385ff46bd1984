"""The `triton` attention backend: kiln's Triton kernels (kiln.kernels.triton) on the GPU.

Each layer writes the step's K and V into their slots (`write_kv`), then attends: a step
whose every sequence computes one token (T == S, no draft tree) goes to the decode kernel
(`paged_decode_attention`, one program per sequence and kv head, split along long sequences
and reduced), any other step to the prefill/extend kernel (`paged_prefill_attention`: each
sequence's chunk over its cached prefix, causal or by its draft tree), which serves mixed
batches of chunks and decodes as they come. Both read K/V in place through the block tables.

The metadata is built reading one number on the host (eager steps only): the longest
sequence, which sizes the decode split, or the longest query, which sizes the prefill grid.
`graph_metadata` builds a CUDA graph's from static buffers, reading nothing, with the split
fixed by the longest possible sequence (kiln.runner.cuda_graphs). Without a GPU the same
kernels run in Triton's interpreter on CPU tensors (TRITON_INTERPRET=1): slow, but what CI
checks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.kernels.triton import decode_attention, kv_cache, prefill_attention
from kiln.models.layers.attention import SeqLayout
from kiln.runner.slots import slot_mapping_for


@dataclass
class TritonAttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot of each flat token
    layout: SeqLayout
    block_size: int
    # decode steps (one token per sequence): [S] keys per sequence, None for any other step
    seq_lens: torch.Tensor | None
    max_seq_len: int  # decode: a bound on seq_lens (the decode split is chosen from it)
    max_query_len: int  # the longest of layout.query_lens (sizes the prefill grid)


class TritonPagedAttention:
    """Paged attention through kiln's Triton kernels; decode steps can be graph-captured."""

    def __init__(self):
        self.num_sms = (torch.cuda.get_device_properties(torch.cuda.current_device())
                        .multi_processor_count if torch.cuda.is_available() else 132)

    def build_metadata(self, layout: SeqLayout, positions: torch.Tensor, block_size: int,
                       slot_mapping: torch.Tensor | None = None) -> TritonAttentionMetadata:
        if slot_mapping is None:
            slot_mapping = slot_mapping_for(layout, positions, block_size)
        num_tokens, num_seqs = len(positions), len(layout.query_lens)
        if num_tokens == num_seqs and layout.tree_mask is None:  # every query is one token
            seq_lens = layout.seq_lens
            return self._decode(layout, slot_mapping, seq_lens, block_size,
                                int(seq_lens.max()) if num_seqs else 0)
        return TritonAttentionMetadata(slot_mapping, layout, block_size, None, 0,
                                       int(layout.query_lens.max()))

    def graph_metadata(self, layout: SeqLayout, seq_lens: torch.Tensor,
                       slot_mapping: torch.Tensor, block_size: int,
                       max_seq_len: int) -> TritonAttentionMetadata:
        """A decode step over static buffers (`seq_lens` among them, kept up to date by the
        caller): the split count fixed by `max_seq_len`, the longest possible sequence."""
        return self._decode(layout, slot_mapping, seq_lens, block_size, max_seq_len)

    def _decode(self, layout: SeqLayout, slot_mapping: torch.Tensor, seq_lens: torch.Tensor,
                block_size: int, max_seq_len: int) -> TritonAttentionMetadata:
        return TritonAttentionMetadata(slot_mapping, layout, block_size, seq_lens,
                                       max_seq_len, 1)

    def forward(self, q, k, v, kv_cache_pair, meta: TritonAttentionMetadata, scale: float):
        k_cache, v_cache = kv_cache_pair
        kv_cache.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        s = meta.layout
        if meta.seq_lens is not None:
            splits = decode_attention.choose_num_splits(meta.max_seq_len, len(q),
                                                        k_cache.shape[1], self.num_sms)
            out = decode_attention.paged_decode_attention(
                q, k_cache, v_cache, s.block_table, meta.seq_lens, meta.block_size, scale,
                splits)
        else:
            out = prefill_attention.paged_prefill_attention(
                q, k_cache, v_cache, s.block_table, s.query_start, s.query_lens,
                s.context_lens, meta.block_size, scale, meta.max_query_len, s.tree_mask)
        return out.reshape(len(q), -1)
