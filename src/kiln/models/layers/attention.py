"""The attention interface the model calls (a contract: types only, no implementation).

A model's attention layer hands its q, k and v to an `AttentionBackend` together with its
layer's paged KV cache and the step's metadata, which the runner built once per step with the
same backend's `build_metadata` and passes down unopened. Backends live in kiln.runner.attention
(the torch reference, kiln's C++ CPU kernels); a GPU backend is one more class there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class SeqLayout:
    """Where each scheduled sequence's tokens sit in the flat batch (all [num_seqs], int64)."""

    query_start: torch.Tensor  # first flat index of the sequence's tokens
    query_lens: torch.Tensor  # tokens computed this step (prefill chunk, 1, or 1 + drafts)
    context_lens: torch.Tensor  # tokens already in the cache before this step
    block_table: torch.Tensor  # [num_seqs, max_blocks] block ids, padded with 0
    # [T] int64 over the whole flat batch, or None: a token's nonzero entry m makes it attend,
    # among its own sequence's query tokens, only those j with bit j of m set (a draft tree:
    # its ancestors and itself; kiln.speculative); 0 = causal as usual. Only short queries
    # carry trees.
    tree_mask: torch.Tensor | None = None
    # the largest query_lens entry where the builder knew it as a Python int (kiln.runner.
    # batch), so a backend splits short from long queries without reading a device tensor
    max_query_len: int | None = None

    @property
    def seq_lens(self) -> torch.Tensor:
        return self.context_lens + self.query_lens


class AttentionMetadata(Protocol):
    """A step's attention metadata: built once per step, shared by every layer; its other
    fields are the backend's own."""

    slot_mapping: torch.Tensor  # [T] cache slot of each flat token


class AttentionBackend(Protocol):
    def build_metadata(self, layout: SeqLayout, positions: torch.Tensor, block_size: int,
                       slot_mapping: torch.Tensor | None = None) -> AttentionMetadata:
        """The step's metadata for `layout` (on the layout's device). slot_mapping: the
        tokens' cache slots where the caller has them already (else derived from the block
        tables)."""
        ...

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                scale: float) -> torch.Tensor:
        """q: [T, Hq, D], k/v: [T, Hkv, D] -> [T, Hq * D]; writes k/v into `kv_cache`."""
        ...
