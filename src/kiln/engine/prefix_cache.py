"""Prefix caching: the block hash -> block map, and KV events.

Blocks are identified by their chained hashes (kiln.engine.block_hash, which the router
hashes prompts with too). The pool calls `evict` and `clear` here through its
`ContentIndex` seam, so the pool does not import this module.

Events (`BlockStored`, `BlockRemoved`, `AllCleared`) are collected when `emit_events` is on and
drained by the worker, which numbers and publishes them.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from kiln.engine.block_hash import BlockHash
from kiln.engine.block_pool import KVBlock


class BlockStored(msgspec.Struct, tag=True):
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int


class BlockRemoved(msgspec.Struct, tag=True):
    block_hashes: list[bytes]


class AllCleared(msgspec.Struct, tag=True):
    pass


KVEvent = BlockStored | BlockRemoved | AllCleared


class PrefixCache:
    """Map from block hash to the block holding it. Blocks stay mapped while they are in use
    and while they sit unreferenced in the pool's free list; the pool unmaps a block (via
    `evict`) only when it hands that block out for new content."""

    def __init__(self, block_size: int, enabled: bool = True, emit_events: bool = False):
        self.block_size = block_size
        self.enabled = enabled
        self.emit_events = emit_events
        self._blocks: dict[BlockHash, KVBlock] = {}
        self._events: list[KVEvent] = []

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._blocks

    def match(self, block_hashes: Sequence[BlockHash]) -> list[KVBlock]:
        """Blocks for the longest run of leading hashes present in the cache."""
        hits: list[KVBlock] = []
        if not self.enabled:
            return hits
        for block_hash in block_hashes:
            block = self._blocks.get(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def insert(self, block: KVBlock, block_hash: BlockHash, parent: BlockHash | None,
               token_ids: Sequence[int]) -> None:
        """Record that `block` now holds the full block `block_hash` (first writer wins)."""
        if not self.enabled or block.block_hash is not None:
            return
        if block_hash in self._blocks:
            return  # an identical block is already cached; this copy stays private
        block.block_hash = block_hash
        self._blocks[block_hash] = block
        if self.emit_events:
            self._events.append(BlockStored([block_hash], parent, list(token_ids),
                                            self.block_size))

    def evict(self, block: KVBlock) -> None:
        """Forget `block`'s content; called by the pool before the block is reused."""
        if block.block_hash is None:
            return
        if self._blocks.get(block.block_hash) is block:
            del self._blocks[block.block_hash]
            if self.emit_events:
                self._events.append(BlockRemoved([block.block_hash]))
        block.block_hash = None

    def clear(self) -> None:
        for block in self._blocks.values():
            block.block_hash = None
        self._blocks.clear()
        if self.emit_events:
            self._events.append(AllCleared())

    def held_hashes(self) -> list[BlockHash]:
        return list(self._blocks)

    def take_events(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events
