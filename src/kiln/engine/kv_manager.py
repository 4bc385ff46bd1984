"""Per-request block tables over the shared block pool.

Lifecycle for one request: `find_cached_prefix` (once, at admission) -> `allocate` every step
it is scheduled (extends its table to cover the tokens about to be computed) -> `trim` after
rejected draft tokens -> `free` when it finishes or is preempted. A full block is published to
the prefix cache as soon as all its tokens are known (drafts never count), which is before its
KV is computed: the step that allocates it always computes it, in the same forward pass.
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.config import CacheConfig
from kiln.engine.block_hash import extend_block_hashes
from kiln.engine.block_pool import BlockPool, KVBlock
from kiln.engine.prefix_cache import PrefixCache
from kiln.engine.request import Request


@dataclass
class KVCacheStats:
    num_blocks: int
    used_blocks: int
    cached_blocks: int
    query_tokens: int  # prompt tokens looked up in the prefix cache
    hit_tokens: int  # of which were found

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    @property
    def usage(self) -> float:
        return self.used_blocks / self.num_blocks


class KVCacheManager:
    def __init__(self, config: CacheConfig, num_blocks: int, emit_events: bool = False):
        self.block_size = config.block_size
        self.caching = config.enable_prefix_caching
        self.prefix_cache = PrefixCache(config.block_size, config.enable_prefix_caching,
                                        emit_events)
        self.pool = BlockPool(num_blocks, self.prefix_cache)
        self._blocks: dict[str, list[KVBlock]] = {}
        self._block_ids: dict[str, list[int]] = {}
        self._num_published: dict[str, int] = {}  # leading blocks already offered to the cache
        self._query_tokens = 0
        self._hit_tokens = 0

    # -- queries --------------------------------------------------------------------------

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table (read-only; valid until its next allocate/trim/free)."""
        return self._block_ids.get(request_id, [])

    def dp_rank(self, request_id: str) -> int:
        """The data-parallel rank whose pool holds the request: one pool, rank 0
        (kiln.engine.dp_kv holds one pool per rank)."""
        return 0

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def stats(self) -> KVCacheStats:
        return KVCacheStats(self.pool.num_blocks, self.pool.num_used_blocks,
                            len(self.prefix_cache), self._query_tokens, self._hit_tokens)

    def set_prefix_caching(self, enabled: bool) -> None:
        """Switch prefix caching between runs (benchmarks); drops cached content."""
        self.pool.reset_prefix_cache()
        self.caching = self.prefix_cache.enabled = enabled

    # -- lifecycle ------------------------------------------------------------------------

    def find_cached_prefix(self, request: Request) -> list[KVBlock]:
        """Cached blocks holding the request's longest known prefix. The last token is never
        matched: its logits are needed to sample, so at least one token is always computed."""
        if not self.caching or request.params.prompt_logprobs is not None:
            return []
        self._hash_known_blocks(request, request.num_tokens - 1)
        usable = (request.num_tokens - 1) // self.block_size
        hits = self.prefix_cache.match(request.block_hashes[:usable])
        self._query_tokens += request.num_tokens
        self._hit_tokens += len(hits) * self.block_size
        return hits

    def allocate(self, request: Request, num_new_tokens: int,
                 cached: list[KVBlock] | None = None) -> bool:
        """Extend the request's table to cover `num_computed_tokens (+ cached) + num_new_tokens`
        tokens, taking `cached` prefix blocks first. False (and no change) if blocks run out."""
        cached = cached or []
        table = self._blocks.setdefault(request.request_id, [])
        ids = self._block_ids.setdefault(request.request_id, [])
        total = request.num_computed_tokens + len(cached) * self.block_size + num_new_tokens
        num_new_blocks = self.blocks_needed(total) - len(table) - len(cached)
        revived = sum(1 for b in cached if b.ref_cnt == 0)  # leave the free list when touched
        if num_new_blocks > self.pool.num_free_blocks - revived:
            if not table:
                self._forget(request.request_id)
            return False
        if cached:
            self.pool.touch(cached)
            table.extend(cached)
            ids.extend(b.block_id for b in cached)
            self._num_published[request.request_id] = len(table)
        if num_new_blocks > 0:
            new = self.pool.allocate(num_new_blocks)
            table.extend(new)
            ids.extend(b.block_id for b in new)
        self._publish_full_blocks(request, min(total, request.num_tokens))
        return True

    def trim(self, request: Request, num_tokens: int) -> None:
        """Release blocks past the first `num_tokens` tokens (rejected draft slots)."""
        table = self._blocks.get(request.request_id)
        if not table:
            return
        keep = self.blocks_needed(num_tokens)
        if keep < len(table):
            dropped = table[keep:]
            del table[keep:]
            del self._block_ids[request.request_id][keep:]
            self.pool.release(reversed(dropped))

    def free(self, request: Request) -> None:
        """Release all of the request's blocks, tail first, so its prefix is evicted last."""
        table = self._forget(request.request_id)
        if table:
            self.pool.release(reversed(table))

    def _forget(self, request_id: str) -> list[KVBlock]:
        self._block_ids.pop(request_id, None)
        self._num_published.pop(request_id, None)
        return self._blocks.pop(request_id, [])

    # -- prefix cache publication --------------------------------------------------------

    def _hash_known_blocks(self, request: Request, num_tokens: int) -> None:
        if len(request.block_hashes) * self.block_size + self.block_size <= num_tokens:
            extend_block_hashes(request.block_hashes, request.all_token_ids[:num_tokens],
                                self.block_size, request.cache_salt)

    def _publish_full_blocks(self, request: Request, num_known_tokens: int) -> None:
        if not self.caching:
            return
        num_full = num_known_tokens // self.block_size
        start = self._num_published.get(request.request_id, 0)
        if num_full <= start:
            return
        self._hash_known_blocks(request, num_full * self.block_size)
        table, hashes, bs = self._blocks[request.request_id], request.block_hashes, self.block_size
        for i in range(start, num_full):
            parent = hashes[i - 1] if i else None
            tokens = request.all_token_ids[i * bs:(i + 1) * bs]
            self.prefix_cache.insert(table[i], hashes[i], parent, tokens)
        self._num_published[request.request_id] = num_full

    # -- KV transfer between workers (kiln.cluster) -----------------------------------------

    def num_cached_prefix(self, block_hashes: list[bytes]) -> int:
        """How many leading `block_hashes` this cache holds now."""
        return len(self.prefix_cache.match(block_hashes)) if self.caching else 0

    def hold_cached(self, block_hashes: list[bytes]) -> list[KVBlock]:
        """Pin the cached blocks of the longest run of leading `block_hashes` (one reference
        each), so they survive eviction until `release_held` (a prefill kept for transfer)."""
        blocks = self.prefix_cache.match(block_hashes) if self.caching else []
        self.pool.touch(blocks)
        return blocks

    def release_held(self, blocks: list[KVBlock]) -> None:
        """Drop the references `hold_cached` or `allocate_for_import` took (tail first)."""
        self.pool.release(reversed(blocks))

    def allocate_for_import(self, num_blocks: int) -> list[KVBlock] | None:
        """Free blocks to receive transferred KV, or None if too few are free."""
        if not self.caching or num_blocks > self.pool.num_free_blocks:
            return None
        return self.pool.allocate(num_blocks)

    def register_imported(self, blocks: list[KVBlock], block_hashes: list[bytes],
                          parent: bytes | None, token_ids: list[int]) -> None:
        """Publish blocks whose KV was just written (validated) as cached under their hashes
        (`token_ids` = the blocks' tokens, for the KV event), then release them: they wait in
        the free list, cached, for the request that needs them."""
        bs = self.block_size
        for i, (block, block_hash) in enumerate(zip(blocks, block_hashes, strict=True)):
            self.prefix_cache.insert(block, block_hash, parent, token_ids[i * bs:(i + 1) * bs])
            parent = block_hash
        self.release_held(blocks)
