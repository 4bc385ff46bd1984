"""The scheduler as a pure state machine, driven with hand-built runner outputs."""

from __future__ import annotations

from kiln.config import CacheConfig, SchedulerConfig
from kiln.engine.contract import RunnerOutput
from kiln.engine.kv_manager import KVCacheManager
from kiln.engine.request import Request, RequestStatus
from kiln.engine.scheduler import Scheduler
from kiln.sampling_params import SamplingParams

BS = 4


def make(num_blocks=16, budget=64, max_seqs=8, policy="fcfs", caching=True) -> Scheduler:
    kv = KVCacheManager(CacheConfig(block_size=BS, enable_prefix_caching=caching), num_blocks)
    cfg = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, policy=policy)
    return Scheduler(cfg, kv, max_model_len=256)


def req(rid, n, max_tokens=4, t0=0.0, priority=0, eos=frozenset({2})):
    return Request(rid, list(range(10, 10 + n)), SamplingParams(max_tokens=max_tokens),
                   eos_token_ids=eos, priority=priority, arrival_time=t0)


def run_step(s: Scheduler, token: int = 7):
    out = s.schedule()
    sampled = [[token] if item.samples else [] for item in out.scheduled]
    return out, s.update(out, RunnerOutput(sampled))


def test_decodes_first_then_chunked_prefill_under_budget():
    s = make(budget=10)
    s.add_request(req("a", 3, t0=0))
    out, _ = run_step(s)
    assert [(i.request_id, len(i.token_ids)) for i in out.scheduled] == [("a", 3)]
    s.add_request(req("b", 20, t0=1))
    out, _ = run_step(s)
    # a decodes 1 token first; b gets the 9 left in the budget
    assert [(i.request_id, len(i.token_ids), i.samples) for i in out.scheduled] == [
        ("a", 1, True), ("b", 9, False)]
    out, _ = run_step(s)
    assert [(i.request_id, i.start_pos, len(i.token_ids)) for i in out.scheduled] == [
        ("a", 4, 1), ("b", 9, 9)]
    out, _ = run_step(s)
    assert [(i.request_id, len(i.token_ids), i.samples) for i in out.scheduled] == [
        ("a", 1, True), ("b", 2, True)]


def test_max_tokens_and_eos_finish_and_free():
    s = make()
    s.add_request(req("a", 5, max_tokens=2))
    s.add_request(req("b", 5, max_tokens=9, t0=1))
    _, outs = run_step(s)
    assert [o.finish_reason for o in outs] == [None, None]
    out = s.schedule()
    res = s.update(out, RunnerOutput([[7], [2]]))  # b samples EOS
    assert [(o.request_id, o.finish_reason) for o in res] == [("a", "length"), ("b", "stop")]
    assert s.kv.stats().used_blocks == 0 and not s.has_work()
    assert s.schedule().finished_ids == ["a", "b"]


def test_preemption_frees_the_newest_request_and_it_recomputes():
    s = make(num_blocks=4, budget=64, caching=False)
    s.add_request(req("a", 7, max_tokens=10, t0=0))  # 2 blocks
    s.add_request(req("b", 7, max_tokens=10, t0=1))  # 2 blocks
    run_step(s)
    run_step(s)  # 8 tokens each: blocks full
    assert s.kv.pool.num_free_blocks == 0
    out, _ = run_step(s)  # both need a third block for token 9 -> b is preempted
    assert [i.request_id for i in out.scheduled] == ["a"]
    b = s.requests["b"]
    # PREEMPTED, not WAITING: `_preempt` marks it so and requeues it, and nothing admits it
    # this step (a step that preempts skips admission, and only admission changes the status)
    assert b.status == RequestStatus.PREEMPTED
    assert b.num_computed_tokens == 0 and s.num_preemptions == 1


def test_priority_policy_preempts_the_least_important():
    s = make(num_blocks=4, policy="priority", caching=False)
    s.add_request(req("vip", 7, max_tokens=10, t0=1, priority=0))
    s.add_request(req("bulk", 7, max_tokens=10, t0=0, priority=9))
    out, _ = run_step(s)
    assert [i.request_id for i in out.scheduled] == ["vip", "bulk"]
    run_step(s)
    out, _ = run_step(s)
    assert [i.request_id for i in out.scheduled] == ["vip"]
    assert s.requests["bulk"].status == RequestStatus.PREEMPTED


def test_draft_tokens_ride_along_and_rejections_roll_back():
    s = make()
    r = req("a", 6, max_tokens=20)
    s.add_request(r)
    run_step(s)  # prefill 6, sample 1 -> 7 tokens, 6 computed
    r.spec_token_ids = [40, 41, 42, 43, 44, 45]
    out = s.schedule()
    item = out.scheduled[0]
    assert item.token_ids == [7, 40, 41, 42, 43, 44, 45] and item.num_draft_tokens == 6
    assert len(s.kv.block_ids("a")) == 4  # 13 tokens of 4-token blocks
    outs = s.update(out, RunnerOutput([[40, 9]]))  # draft 40 accepted, 41 rejected, bonus 9
    assert outs[0].new_token_ids == [40, 9]
    assert outs[0].num_draft_tokens == 6 and outs[0].num_accepted_tokens == 1
    assert r.num_computed_tokens == 8 and r.num_tokens == 9 and r.spec_token_ids == []
    assert len(s.kv.block_ids("a")) == 3  # rejected slots released; 9 tokens need 3


def test_abort_of_waiting_and_running_requests():
    s = make(max_seqs=1)
    s.add_request(req("a", 3))
    s.add_request(req("b", 3, t0=1))
    run_step(s)
    s.finish_requests(["a", "b"], RequestStatus.FINISHED_ABORTED)
    out = s.schedule()
    assert out.empty and sorted(out.finished_ids) == ["a", "b"]
    outs = s.update(out, RunnerOutput([]))
    assert sorted((o.request_id, o.finish_reason) for o in outs) == [("a", "abort"),
                                                                     ("b", "abort")]
    assert s.kv.stats().used_blocks == 0


def test_max_num_seqs_caps_running():
    s = make(max_seqs=2)
    for i in range(4):
        s.add_request(req(f"r{i}", 3, t0=i))
    out, _ = run_step(s)
    assert [i.request_id for i in out.scheduled] == ["r0", "r1"]
    assert s.num_waiting == 2
