"""Prefix caching: chained block hashes, the hash -> block map, and KV events.

A full block's hash covers its parent's hash, its token ids and extra keys (the tenant's cache
salt, folded into the first block only so that every later hash inherits it). Two requests
share a block exactly when their token prefixes (and salts) are identical up to that block's
end. The router hashes prompts with the same `hash_block_tokens`, so its view and the
workers' caches agree bit for bit.

Events (`BlockStored`, `BlockRemoved`, `AllCleared`) are collected when `emit_events` is on and
drained by the worker, which numbers and publishes them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

import msgspec
import numpy as np

if TYPE_CHECKING:
    from kiln.engine.block_pool import KVBlock

BlockHash = bytes  # 16 bytes of sha256


def hash_block_tokens(parent: BlockHash | None, token_ids: Sequence[int],
                      salt: str | None = None) -> BlockHash:
    """Hash of one full block, chained on its parent's hash (None for the first block)."""
    h = hashlib.sha256(parent or b"\0")
    if parent is None and salt:
        h.update(b"salt:" + salt.encode())
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return h.digest()[:16]


def hash_prompt_blocks(token_ids: Sequence[int], block_size: int,
                       salt: str | None = None) -> list[BlockHash]:
    """Hashes of every full block of `token_ids` (what the router computes for a prompt)."""
    hashes: list[BlockHash] = []
    extend_block_hashes(hashes, token_ids, block_size, salt)
    return hashes


def extend_block_hashes(hashes: list[BlockHash], token_ids: Sequence[int], block_size: int,
                        salt: str | None = None) -> None:
    """Append hashes for full blocks of `token_ids` not yet covered by `hashes` (in place)."""
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        parent = hashes[-1] if hashes else None
        hashes.append(hash_block_tokens(parent, token_ids[start:start + block_size], salt))


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
