"""Where each flat token's K and V go in the paged cache (every attention backend's
`build_metadata` derives it the same way; kiln.runner.attention re-exports it)."""

from __future__ import annotations

import torch

from kiln.models.layers.attention import SeqLayout


def slot_mapping_for(layout: SeqLayout, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """[T] cache slot of each flat token: its sequence's block at position // block_size."""
    seq_of_token = torch.repeat_interleave(
        torch.arange(len(layout.query_lens), device=positions.device), layout.query_lens,
        output_size=len(positions))
    blocks = layout.block_table[seq_of_token, positions // block_size]
    return blocks * block_size + positions % block_size
