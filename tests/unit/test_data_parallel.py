"""Data-parallel attention's pure parts, exact values: the KV pools per rank and where
requests go, the scheduler preempting within a pool, the merged KV events, and how a step is
split by rank and its logits rows put back in order."""

from __future__ import annotations

from kiln.config import CacheConfig, SchedulerConfig
from kiln.engine.contract import ScheduledRequest, SchedulerOutput
from kiln.engine.dp_kv import DataParallelKV, kv_manager_for
from kiln.engine.kv_manager import KVCacheManager
from kiln.engine.prefix_cache import AllCleared, BlockRemoved, BlockStored
from kiln.engine.request import Request, RequestStatus
from kiln.engine.scheduler import Scheduler
from kiln.runner.batch import LogitsRows, build_batch
from kiln.runner.data_parallel import logits_plan, split_by_rank
from kiln.sampling_params import SamplingParams

BS = 4


def make_request(rid: str, num_tokens: int, first: int = 0) -> Request:
    return Request(rid, list(range(first, first + num_tokens)), SamplingParams(max_tokens=8))


def pools(num_blocks: int = 8, size: int = 2, events: bool = False) -> DataParallelKV:
    return DataParallelKV(CacheConfig(block_size=BS), num_blocks, size, events)


def admit(kv: DataParallelKV, req: Request) -> bool:
    cached = kv.find_cached_prefix(req)
    return kv.allocate(req, req.num_tokens - len(cached) * BS, cached)


def test_one_rank_is_one_pool():
    assert isinstance(kv_manager_for(CacheConfig(), 8, 1), KVCacheManager)
    kv = kv_manager_for(CacheConfig(block_size=BS), 8, 2)
    assert isinstance(kv, DataParallelKV) and kv.stats().num_blocks == 16


def test_requests_go_to_the_rank_with_fewest_then_most_free_blocks():
    kv = pools()
    a, b, c, d = (make_request(r, n, 10 * i) for i, (r, n) in
                  enumerate([("a", 9), ("b", 2), ("c", 3), ("d", 1)]))
    for req in (a, b, c, d):
        assert admit(kv, req)
    # a: tie -> rank 0; b: rank 1 (no requests); c: 1 each, rank 1 has more free (7 > 5)
    # blocks; d: rank 0 (1 request against 2)
    assert [kv.dp_rank(r) for r in "abcd"] == [0, 1, 1, 0]
    assert kv.block_ids("a") == [0, 1, 2] and kv.block_ids("d") == [3]  # ids per pool
    assert kv.block_ids("b") == [0] and kv.block_ids("c") == [1]
    assert kv.requests_per_rank() == [2, 2]
    assert [p.stats().used_blocks for p in kv.pools] == [4, 2]
    kv.free(a)
    assert kv.pools[0].stats().used_blocks == 1 and kv.requests_per_rank() == [1, 2]
    assert kv.stats().used_blocks == 3 and kv.stats().num_blocks == 16


def test_prefix_hits_only_on_the_requests_rank():
    kv = pools()
    assert admit(kv, make_request("a", 9))  # rank 0; its 2 full blocks cached there
    second = make_request("b", 9)  # the same prompt, placed on rank 1 (fewest requests):
    assert kv.find_cached_prefix(second) == []  # rank 0's KV is no use there
    assert kv.allocate(second, 9) and kv.dp_rank("b") == 1
    third = make_request("c", 9)  # a tie (1 request, 5 free blocks each): rank 0, a hit
    hits = kv.find_cached_prefix(third)
    assert [b.block_id for b in hits] == [0, 1]
    assert kv.allocate(third, 1, hits) and kv.block_ids("c") == [0, 1, 3]
    assert kv.stats().hit_tokens == 2 * BS


def test_a_request_that_does_not_fit_is_placed_afresh():
    kv = pools(num_blocks=2)
    assert not admit(kv, make_request("big", 9))  # 3 blocks: fits no pool
    assert kv.requests_per_rank() == [0, 0] and kv.block_ids("big") == []


def test_scheduler_preempts_only_requests_of_the_same_pool():
    """Rank 0's pool runs out: the victim is rank 0's latest request, not the latest running
    one (rank 1's, whose blocks would not help)."""
    kv = pools(num_blocks=4)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8), kv, 64)
    for i, rid in enumerate("abcd"):
        sched.add_request(make_request(rid, 4, 10 * i))
    out = sched.schedule()  # alternating: fewest requests, ties to the lower rank
    assert [(s.request_id, s.dp_rank) for s in out.scheduled] == [
        ("a", 0), ("b", 1), ("c", 0), ("d", 1)]
    for s in out.scheduled:  # one full block each; the next token needs a second
        sched.requests[s.request_id].num_computed_tokens = 4
        sched.requests[s.request_id].append_output_token(1)
    kv.pools[0].pool.allocate(kv.pools[0].pool.num_free_blocks)  # rank 0's pool full
    out = sched.schedule()
    assert sched.requests["c"].status == RequestStatus.PREEMPTED  # a grows into its block
    assert [s.request_id for s in out.scheduled] == ["a", "b", "d"]
    assert sched.num_preemptions == 1 and sched.requests["d"].status == RequestStatus.RUNNING


def test_merged_events_store_on_the_first_pool_and_remove_on_the_last():
    kv = pools(events=True)
    caches = [p.prefix_cache for p in kv.pools]
    a, b = make_request("a", 4), make_request("b", 4)  # the same block on both ranks
    kv.pools[0].allocate(a, 4)
    kv.pools[1].allocate(b, 4)
    h = a.block_hashes[0]
    assert [type(e) for e in kv.prefix_cache.take_events()] == [BlockStored]
    assert kv.prefix_cache.held_hashes() == [h]
    caches[0].evict(kv.pools[0]._blocks["a"][0])
    assert kv.prefix_cache.take_events() == []  # rank 1 still holds it
    caches[1].clear()
    assert kv.prefix_cache.take_events() == [BlockRemoved([h])]
    assert not any(isinstance(e, AllCleared) for e in kv.prefix_cache.take_events())


def scheduled(rid: str, tokens: int, start: int, rank: int, samples: bool = True,
              prompt_logprobs: bool = False) -> ScheduledRequest:
    prompt = list(range(start + tokens))
    return ScheduledRequest(rid, prompt[start:], start, 0, [0, 1, 2, 3], samples,
                            SamplingParams(), prompt, [], prompt_logprobs, dp_rank=rank)


def test_a_step_splits_by_rank_and_its_logits_rows_come_back_in_order():
    step = SchedulerOutput([scheduled("a", 3, 0, 1, prompt_logprobs=True),
                            scheduled("b", 1, 5, 0), scheduled("c", 4, 0, 1, samples=False),
                            scheduled("d", 1, 7, 1)], 9)
    parts = split_by_rank(step, 2)
    assert [[s.request_id for s in p.scheduled] for p in parts] == [["b"], ["a", "c", "d"]]
    assert [p.num_batched_tokens for p in parts] == [1, 8]
    rank_rows = [build_batch(p, "cpu").rows for p in parts]
    # rank 1: a's 2 prompt rows + 1 sample row, c none, d 1 sample row -> 4 rows
    assert rank_rows[1] == [LogitsRows(2, 1, 0, 2), LogitsRows(3, 0, 3, 0),
                            LogitsRows(3, 1, 3, 0)]
    plan = logits_plan(step, rank_rows, width=4)  # rank r's row i at r * 4 + i
    assert plan.index == [4, 5, 6, 0, 7]  # a's 3 rows, b's, d's
    assert plan.rows == [LogitsRows(2, 1, 0, 2), LogitsRows(3, 1, 3, 0),
                         LogitsRows(4, 0, 4, 0), LogitsRows(4, 1, 4, 0)]
