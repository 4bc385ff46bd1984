"""The fixed pool of KV blocks: reference counts and an LRU free list.

Every block is either in use (`ref_cnt > 0`) or in the free list (`ref_cnt == 0`), never both.
A free block may still hold cached content (`block_hash` set): it can be revived by a prefix
hit until the pool hands it out for new content, which evicts it from the prefix cache.
The free list is in eviction order: the head is reused first; freed blocks go to the tail.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import Protocol


class KVBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None

    def __repr__(self) -> str:
        cached = "cached" if self.block_hash is not None else "-"
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}, {cached})"


class ContentIndex(Protocol):
    """Where the blocks' cached content is looked up (kiln.engine.prefix_cache.PrefixCache);
    the pool tells it when content goes away."""

    def evict(self, block: KVBlock) -> None:
        """`block` is about to hold new content: forget its old one."""

    def clear(self) -> None:
        """Forget every block's content."""


class BlockPool:
    def __init__(self, num_blocks: int, prefix_cache: ContentIndex):
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.prefix_cache = prefix_cache
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, n: int) -> list[KVBlock]:
        """Take `n` blocks from the head of the free list (evicting their cached content)."""
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} KV blocks, {len(self._free)} free")
        taken = []
        for _ in range(n):
            _, block = self._free.popitem(last=False)
            self.prefix_cache.evict(block)
            block.ref_cnt = 1
            taken.append(block)
        return taken

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Add a reference to each block (prefix hits), reviving free cached blocks."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def release(self, blocks: Iterable[KVBlock]) -> None:
        """Drop a reference from each block; blocks reaching zero join the free list's tail,
        in the order given (pass a request's blocks tail-first so its prefix outlives it)."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block

    def free_block_ids(self) -> list[int]:
        """Free list in eviction order (head first); for tests and debugging."""
        return list(self._free)

    def reset_prefix_cache(self) -> bool:
        """Drop all cached content; only possible when no block is in use."""
        if self.num_used_blocks:
            return False
        self.prefix_cache.clear()
        return True
