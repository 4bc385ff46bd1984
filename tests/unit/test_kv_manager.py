"""KV block pool, prefix cache and per-request tables: exact values and invariants."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kiln.config import CacheConfig
from kiln.engine.block_hash import hash_prompt_blocks
from kiln.engine.kv_manager import KVCacheManager
from kiln.engine.prefix_cache import BlockRemoved, BlockStored
from kiln.engine.request import Request
from kiln.sampling_params import SamplingParams

BS = 4


def make_request(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=8), cache_salt=salt)


def manager(num_blocks: int = 8, caching: bool = True, events: bool = False) -> KVCacheManager:
    return KVCacheManager(CacheConfig(block_size=BS, enable_prefix_caching=caching),
                          num_blocks, emit_events=events)


def admit(kv: KVCacheManager, req: Request) -> bool:
    cached = kv.find_cached_prefix(req)
    num_cached = len(cached) * BS
    ok = kv.allocate(req, req.num_tokens - num_cached, cached)
    if ok:
        req.num_computed_tokens = req.num_tokens  # pretend the step ran
    return ok


def test_allocation_takes_blocks_in_order_and_free_returns_them_tail_first():
    kv = manager()
    req = make_request("a", list(range(10)))  # 3 blocks
    assert admit(kv, req)
    assert kv.block_ids("a") == [0, 1, 2]
    kv.free(req)
    # free list: untouched blocks first, then a's blocks tail first (2, 1, 0)
    assert kv.pool.free_block_ids() == [3, 4, 5, 6, 7, 2, 1, 0]


def test_prefix_hit_reuses_blocks_and_never_matches_last_token():
    kv = manager()
    a = make_request("a", list(range(12)))  # exactly 3 full blocks
    admit(kv, a)
    b = make_request("b", list(range(12)))
    hits = kv.find_cached_prefix(b)
    assert [blk.block_id for blk in hits] == [0, 1]  # the last block holds the last token
    assert kv.allocate(b, 4, hits)
    assert kv.block_ids("b") == [0, 1, 3]
    assert [kv.pool.blocks[i].ref_cnt for i in (0, 1, 2, 3)] == [2, 2, 1, 1]


def test_cache_salt_isolates_tenants():
    kv = manager()
    admit(kv, make_request("a", list(range(9)), salt="tenant-1"))
    assert kv.find_cached_prefix(make_request("b", list(range(9)), salt="tenant-2")) == []
    assert len(kv.find_cached_prefix(make_request("c", list(range(9)), salt="tenant-1"))) == 2
    assert hash_prompt_blocks(list(range(8)), BS, "x") != hash_prompt_blocks(list(range(8)), BS)


def test_eviction_is_lru_and_emits_events():
    kv = manager(num_blocks=4, events=True)
    a = make_request("a", list(range(8)) + [99])  # blocks 0,1 full, 2 partial
    admit(kv, a)
    stored = [e for e in kv.prefix_cache.take_events() if isinstance(e, BlockStored)]
    assert len(stored) == 2 and stored[1].parent_block_hash == stored[0].block_hashes[0]
    kv.free(a)  # free list now [3, 2, 1, 0]
    b = make_request("b", list(range(100, 113)))  # 4 blocks: reuses 3, 2, 1, 0
    admit(kv, b)
    removed = [e for e in kv.prefix_cache.take_events() if isinstance(e, BlockRemoved)]
    assert [r.block_hashes[0] for r in removed] == [stored[1].block_hashes[0],
                                                    stored[0].block_hashes[0]]


def test_freed_cached_block_can_be_revived():
    kv = manager(num_blocks=4)
    a = make_request("a", list(range(9)))
    admit(kv, a)
    kv.free(a)
    b = make_request("b", list(range(9)))
    hits = kv.find_cached_prefix(b)
    assert [h.block_id for h in hits] == [0, 1]
    assert kv.allocate(b, 1, hits)
    assert kv.pool.num_free_blocks == 1


def test_allocation_fails_cleanly_when_blocks_run_out():
    kv = manager(num_blocks=2)
    req = make_request("a", list(range(12)))
    assert not admit(kv, req)
    assert kv.pool.num_free_blocks == 2 and kv.block_ids("a") == []


def test_trim_releases_draft_slots():
    kv = manager()
    req = make_request("a", list(range(7)))
    admit(kv, req)
    req.spec_token_ids = [1, 2, 3, 4, 5]
    assert kv.allocate(req, 1 + 5)  # 7 + 1 + 5 tokens -> 4 blocks
    assert len(kv.block_ids("a")) == 4
    kv.trim(req, 8)
    assert len(kv.block_ids("a")) == 2 and kv.pool.num_free_blocks == 6


ops = st.lists(st.tuples(st.sampled_from(["add", "step", "finish", "abort", "preempt",
                                          "draft"]),
                         st.integers(0, 5), st.integers(1, 30)), max_size=60)


@settings(max_examples=150, deadline=None)
@given(ops=ops, caching=st.booleans())
def test_no_leaks_and_no_negative_refs_under_any_mix(ops, caching):
    kv = manager(num_blocks=12, caching=caching)
    live: dict[int, Request] = {}
    for op, slot, n in ops:
        req = live.get(slot)
        if op == "add" and req is None:
            r = make_request(f"r{slot}-{n}", [(slot * 7 + i) % 5 for i in range(n)])
            if admit(kv, r):
                live[slot] = r
        elif op == "step" and req is not None:
            if kv.allocate(req, 1):
                req.append_output_token(n % 5)
                req.num_computed_tokens = req.num_tokens
        elif op == "draft" and req is not None:
            req.spec_token_ids = [1] * (n % 4 + 1)
            if kv.allocate(req, 1 + len(req.spec_token_ids)):
                kv.trim(req, req.num_tokens)
            req.spec_token_ids = []
        elif op in ("finish", "abort", "preempt") and req is not None:
            kv.free(req)
            del live[slot]
        _check_invariants(kv, live)
    for req in live.values():
        kv.free(req)
    assert kv.pool.num_free_blocks == kv.pool.num_blocks
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)


def _check_invariants(kv: KVCacheManager, live: dict[int, Request]) -> None:
    refs = [0] * kv.pool.num_blocks
    for req in live.values():
        for bid in kv.block_ids(req.request_id):
            refs[bid] += 1
    free = set(kv.pool.free_block_ids())
    for block in kv.pool.blocks:
        assert block.ref_cnt >= 0
        assert block.ref_cnt == refs[block.block_id]  # no leaks, no phantom references
        assert (block.ref_cnt == 0) == (block.block_id in free)  # evictable = unused
