"""Routing policies and load tracking on hand-built worker states: exact costs and choices."""

from __future__ import annotations

import math

import pytest

from kiln.cluster.kv_index import KVIndex
from kiln.cluster.router import (
    Candidate,
    KVAware,
    LeastLoad,
    LoadTracker,
    RoundRobin,
    Router,
    WorkerState,
    decide,
    make_policy,
)
from kiln.engine.block_hash import hash_prompt_blocks
from kiln.engine.prefix_cache import BlockStored


def dynamo_example() -> list[WorkerState]:
    """Dynamo's worked example: a 10-block prompt; cached 2 / 5 / 8, decode load 10 / 5 / 9."""
    return [WorkerState("w1", cached_blocks=2, active_blocks=10),
            WorkerState("w2", cached_blocks=5, active_blocks=5),
            WorkerState("w3", cached_blocks=8, active_blocks=9)]


def test_kv_aware_cost_is_uncached_prefill_plus_queue_plus_decode():
    d = decide(KVAware(), 10, dynamo_example(), commit=True)
    assert [s.cost for s in d.scores] == [18.0, 10.0, 11.0]
    assert [s.prefill_blocks for s in d.scores] == [8, 5, 2]
    assert d.chosen == "w2" and d.hit_blocks == 5
    assert [s.probability for s in d.scores] == [0.0, 1.0, 0.0]


def test_prefill_weight_scales_only_the_uncached_blocks():
    d = decide(KVAware(prefill_weight=2.0), 10, dynamo_example(), commit=True)
    assert [s.cost for s in d.scores] == [26.0, 15.0, 13.0]
    assert d.chosen == "w3"


def test_queued_prefill_counts_and_cache_never_goes_below_zero():
    workers = [WorkerState("w1", cached_blocks=12, queued_prefill_blocks=7),
               WorkerState("w2", cached_blocks=0, queued_prefill_blocks=0, active_blocks=3)]
    d = decide(KVAware(), 10, workers, commit=True)
    assert [s.cost for s in d.scores] == [7.0, 13.0]
    assert d.scores[0].prefill_blocks == 0 and d.chosen == "w1"


def test_ties_go_to_the_emptier_cache_then_the_first_worker():
    workers = [WorkerState("w1", active_blocks=4), WorkerState("w2", active_blocks=4)]
    assert decide(KVAware(), 3, workers, commit=True).chosen == "w1"
    workers = [WorkerState("w1", active_blocks=4, cache_blocks=30),
               WorkerState("w2", active_blocks=4, cache_blocks=10)]
    assert decide(KVAware(), 3, workers, commit=True).chosen == "w2"
    assert decide(LeastLoad(), 3, workers, commit=True).chosen == "w2"


def test_overloaded_workers_are_skipped_unless_all_are():
    workers = dynamo_example()
    workers[1] = WorkerState("w2", cached_blocks=5, active_blocks=5, overloaded=True)
    d = decide(KVAware(), 10, workers, commit=True)
    assert d.chosen == "w3" and d.score("w2").probability == 0.0
    everyone = [WorkerState(w.worker_id, w.cached_blocks, 0, w.active_blocks, True)
                for w in dynamo_example()]
    assert decide(KVAware(), 10, everyone, commit=True).chosen == "w2"


def test_softmax_probabilities_follow_normalized_costs():
    workers = [WorkerState("w1", active_blocks=10), WorkerState("w2", active_blocks=20)]
    d = decide(KVAware(temperature=1.0), 0, workers, commit=False)
    p1 = 1 / (1 + math.exp(-0.5))  # exp(-10/20) : exp(-20/20)
    assert d.score("w1").probability == pytest.approx(p1)
    assert d.score("w2").probability == pytest.approx(1 - p1)
    assert d.chosen == "w1"  # a preview shows the cheapest


def test_softmax_sampling_spreads_by_those_probabilities():
    policy = KVAware(temperature=1.0, seed=7)
    workers = [WorkerState("w1", active_blocks=10), WorkerState("w2", active_blocks=20)]
    picks = [decide(policy, 0, workers, commit=True).chosen for _ in range(2000)]
    assert picks.count("w1") / 2000 == pytest.approx(1 / (1 + math.exp(-0.5)), abs=0.04)


def test_least_load_ignores_the_cache():
    d = decide(LeastLoad(), 10, dynamo_example(), commit=True)
    assert [s.cost for s in d.scores] == [10.0, 5.0, 9.0] and d.chosen == "w2"
    d = decide(LeastLoad(), 10, [WorkerState("a", 9, 0, 6), WorkerState("b", 0, 2, 3)], True)
    assert d.chosen == "b"


def test_round_robin_cycles_and_explaining_does_not_advance_it():
    policy, workers = RoundRobin(), dynamo_example()
    assert decide(policy, 10, workers, commit=False).chosen == "w1"
    assert decide(policy, 10, workers, commit=False).chosen == "w1"
    picks = [decide(policy, 10, workers, commit=True).chosen for _ in range(4)]
    assert picks == ["w1", "w2", "w3", "w1"]


def test_make_policy_names():
    assert isinstance(make_policy("kv-aware", 2.0, 0.5), KVAware)
    with pytest.raises(ValueError, match="router must be"):
        make_policy("random")


def test_load_tracker_charges_until_the_first_token_and_frees_on_release():
    loads = LoadTracker(block_size=4)
    loads.charge("r1", "w1", num_tokens=10, prefill_blocks=2)  # 3 KV blocks
    loads.charge("r2", "w1", num_tokens=4, prefill_blocks=1)  # 1 KV block
    assert (loads.queued_prefill_blocks("w1"), loads.active_blocks("w1")) == (3, 4)
    loads.progressed("r1", 1)  # first token: prefill done; 11 tokens still 3 blocks
    assert (loads.queued_prefill_blocks("w1"), loads.active_blocks("w1")) == (1, 4)
    loads.progressed("r1", 2)  # 13 tokens: 4 blocks
    assert loads.active_blocks("w1") == 5
    loads.charge("r1", "w2", num_tokens=13, prefill_blocks=0)  # moved (migration)
    assert (loads.active_blocks("w1"), loads.active_blocks("w2")) == (1, 4)
    loads.forget_worker("w1")
    assert (loads.queued_prefill_blocks("w1"), loads.active_blocks("w1")) == (0, 0)
    loads.release("r1")
    assert loads.active_blocks("w2") == 0 and loads.num_open("w2") == 0


def test_router_reads_the_index_with_the_tenant_salt():
    index, loads = KVIndex(), LoadTracker(block_size=4)
    prompt = list(range(13))  # 3 full blocks; the engine can reuse (13 - 1) // 4 = 3
    for w in ("w1", "w2"):
        index.add_worker(w)
        index.load_snapshot(w, 0, [])
    hashes = hash_prompt_blocks(prompt, 4, "tenant-a")
    index.apply("w2", 1, [BlockStored(hashes[:2], None, [], 4)])
    router = Router(KVAware(), index, loads)
    cands = [Candidate("w1"), Candidate("w2")]
    d = router.explain(prompt, "tenant-a", cands)
    assert (d.prompt_blocks, d.chosen, d.score("w2").cached_blocks) == (3, "w2", 2)
    other = router.explain(prompt, "tenant-b", cands)  # another tenant never matches
    assert [s.cached_blocks for s in other.scores] == [0, 0] and other.chosen == "w1"
    assert loads.num_open("w2") == 0  # explaining charged nothing
    router.route("r1", prompt, "tenant-a", cands)
    assert (loads.queued_prefill_blocks("w2"), loads.active_blocks("w2")) == (1, 4)


def test_the_last_token_is_never_counted_as_cached():
    index, loads = KVIndex(), LoadTracker(block_size=4)
    index.add_worker("w1")
    index.load_snapshot("w1", 0, hash_prompt_blocks(list(range(8)), 4))
    d = Router(KVAware(), index, loads).explain(list(range(8)), None, [Candidate("w1")])
    assert d.prompt_blocks == 1 and d.score("w1").cached_blocks == 1  # (8 - 1) // 4
