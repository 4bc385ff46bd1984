"""KV pools of data-parallel attention: one KVCacheManager per rank behind the scheduler.

Under data-parallel attention (docs/moe.md, "Data-parallel attention") each of D ranks holds
the KV of its own requests only, so the engine's one scheduler sees D pools of N blocks each
(block ids 0..N-1 in every pool; `ScheduledRequest.dp_rank` says whose). `DataParallelKV`
has KVCacheManager's interface, and a request's calls go to its rank's manager:

- a request gets its rank at admission (`find_cached_prefix`, then `allocate`): the rank with
  the fewest requests holding blocks (a step runs as long as its busiest rank, and each
  request costs its rank attention and a decode row), ties to the one with the most free
  blocks, then the lower rank. It keeps that rank until it finishes or is preempted (its
  blocks freed; it is placed again when readmitted, and recomputes);
- prefix-cache hits are looked up in that rank's cache only (KV on another rank is no use);
- the scheduler preempts only requests of the same pool when one runs out
  (Scheduler._allocate_or_preempt asks `dp_rank`);
- stats add the pools up; KV events merge the pools' (`MergedPrefixEvents`): the gateway's
  index hears a block stored when the first pool caches it and removed when the last drops it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from kiln.config import CacheConfig
from kiln.engine.block_hash import BlockHash
from kiln.engine.block_pool import KVBlock
from kiln.engine.kv_manager import KVCacheManager, KVCacheStats
from kiln.engine.prefix_cache import AllCleared, BlockRemoved, BlockStored, KVEvent, PrefixCache
from kiln.engine.request import Request


def kv_manager_for(config: CacheConfig, num_blocks: int, data_parallel_size: int,
                   emit_events: bool = False) -> KVCacheManager | DataParallelKV:
    """The engine's KV manager: one pool of `num_blocks`, or one per data-parallel rank."""
    if data_parallel_size == 1:
        return KVCacheManager(config, num_blocks, emit_events)
    return DataParallelKV(config, num_blocks, data_parallel_size, emit_events)


class DataParallelKV:
    """D KV pools of `num_blocks` each, one per data-parallel rank; every request in one."""

    def __init__(self, config: CacheConfig, num_blocks: int, size: int,
                 emit_events: bool = False):
        self.pools = [KVCacheManager(config, num_blocks, emit_events) for _ in range(size)]
        self.block_size = config.block_size
        self.prefix_cache = MergedPrefixEvents([p.prefix_cache for p in self.pools])
        self._rank_of: dict[str, int] = {}  # requests holding blocks -> their rank
        self._placed: dict[str, int] = {}  # admitted this step, not yet allocated

    # -- queries ------------------------------------------------------------------------

    def dp_rank(self, request_id: str) -> int:
        """The rank whose pool holds the request (0 for one that holds no blocks)."""
        return self._rank_of.get(request_id, 0)

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table in its rank's pool."""
        return self._pool_of(request_id).block_ids(request_id)

    def blocks_needed(self, num_tokens: int) -> int:
        return self.pools[0].blocks_needed(num_tokens)

    def stats(self) -> KVCacheStats:
        """Every pool's blocks and lookups added up."""
        each = [p.stats() for p in self.pools]
        return KVCacheStats(*(sum(getattr(s, f) for s in each) for f in (
            "num_blocks", "used_blocks", "cached_blocks", "query_tokens", "hit_tokens")))

    def requests_per_rank(self) -> list[int]:
        """Requests holding blocks in each rank's pool."""
        counts = Counter(self._rank_of.values())
        return [counts[rank] for rank in range(len(self.pools))]

    def set_prefix_caching(self, enabled: bool) -> None:
        for pool in self.pools:
            pool.set_prefix_caching(enabled)

    # -- lifecycle (KVCacheManager's) ---------------------------------------------------

    def find_cached_prefix(self, request: Request) -> list[KVBlock]:
        """Place a request being admitted on a rank (the least loaded) and return that
        rank's cached blocks of its prefix."""
        rank = self._rank_of.get(request.request_id)
        if rank is None:
            rank = self._placed[request.request_id] = self.least_loaded()
        return self.pools[rank].find_cached_prefix(request)

    def allocate(self, request: Request, num_new_tokens: int,
                 cached: list[KVBlock] | None = None) -> bool:
        rid = request.request_id
        rank = self._rank_of.get(rid)
        if rank is None:
            rank = self._placed.pop(rid, None)
            rank = self.least_loaded() if rank is None else rank
        if not self.pools[rank].allocate(request, num_new_tokens, cached):
            return False
        self._rank_of[rid] = rank
        return True

    def trim(self, request: Request, num_tokens: int) -> None:
        self._pool_of(request.request_id).trim(request, num_tokens)

    def free(self, request: Request) -> None:
        self._placed.pop(request.request_id, None)
        rank = self._rank_of.pop(request.request_id, None)
        if rank is not None:
            self.pools[rank].free(request)

    def least_loaded(self) -> int:
        """The rank for a new request: fewest requests, then most free blocks, then lowest."""
        requests = self.requests_per_rank()
        return min(range(len(self.pools)), key=lambda r: (
            requests[r], -self.pools[r].pool.num_free_blocks, r))

    def release_held(self, blocks: list[KVBlock]) -> None:
        """(KV transfer between workers, which data-parallel workers refuse: nothing held.)"""
        if blocks:
            raise RuntimeError("data-parallel KV pools hold no blocks for transfer")

    def _pool_of(self, request_id: str) -> KVCacheManager:
        return self.pools[self._rank_of.get(request_id, 0)]


class MergedPrefixEvents:
    """The KV events and held hashes of several pools' prefix caches as one cache's (what
    the worker publishes, kiln.cluster.kv_events): a hash is held while any pool holds it.
    Each event names one block, as PrefixCache emits them."""

    def __init__(self, caches: Sequence[PrefixCache]):
        self.caches = list(caches)
        self._held: list[set[BlockHash]] = [set() for _ in self.caches]  # per pool

    def take_events(self) -> list[KVEvent]:
        merged: list[KVEvent] = []
        for pool, cache in enumerate(self.caches):
            for event in cache.take_events():
                merged.extend(self._merge(pool, event))
        return merged

    def held_hashes(self) -> list[BlockHash]:
        return list(dict.fromkeys(h for cache in self.caches for h in cache.held_hashes()))

    def _merge(self, pool: int, event: KVEvent) -> list[KVEvent]:
        """What the gateway hears of `pool`'s `event`: nothing where another pool still
        holds (or already held) the block."""
        if isinstance(event, AllCleared):
            gone, self._held[pool] = self._held[pool], set()
        elif isinstance(event, BlockStored):
            new = [h for h in event.block_hashes if not self._anywhere(h)]
            self._held[pool].update(event.block_hashes)
            return [event] if new else []
        else:
            gone = set(event.block_hashes) & self._held[pool]
            self._held[pool] -= gone
        last = [h for h in gone if not self._anywhere(h)]
        return [BlockRemoved(last)] if last else []

    def _anywhere(self, block_hash: BlockHash) -> bool:
        return any(block_hash in held for held in self._held)
