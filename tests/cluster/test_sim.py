"""The simulator: step shapes, the cost-model fit, workload shapes, and a small replay."""

from __future__ import annotations

import pytest

from kiln.bench.config import LoadConfig, WorkloadConfig, WorkloadKind
from kiln.bench.sim import IM_START, SimConfig, sim_sessions, simulate
from kiln.bench.sim_cost import CostModel, StepShape, fit_cost_model, step_shape
from kiln.config import CacheConfig, SchedulerConfig
from kiln.engine.kv_manager import KVCacheManager
from kiln.engine.request import Request
from kiln.engine.scheduler import Scheduler
from kiln.sampling_params import SamplingParams


def test_step_shape_splits_prefill_from_decode():
    kv = KVCacheManager(CacheConfig(block_size=4), 64)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=10), kv, 256)
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    sched.add_request(Request("a", list(range(6)), params, arrival_time=0.0))
    first = sched.schedule()
    assert step_shape(first) == StepShape(6, 6 * 3.0, 0, 0)
    from kiln.engine.contract import RunnerOutput
    sched.update(first, RunnerOutput([[7]]))
    sched.add_request(Request("b", list(range(100, 120)), params, arrival_time=1.0))
    second = sched.schedule()  # a decodes (context 7), b prefills its first 9 tokens
    assert step_shape(second) == StepShape(9, 9 * 4.5, 1, 7)


def test_the_fit_recovers_known_coefficients():
    truth = CostModel(0.01, 0.001, 1e-6, 0.002, 1e-5, gateway_s=0.0, source="t")
    shapes = [StepShape(p, p * p / 2, d, c) for p in (0, 16, 256, 1024) for d in (0, 4, 32)
              for c in (0, 500, 4000)]
    fitted = fit_cost_model([(s, truth.step_s(s)) for s in shapes if truth.step_s(s) > 0],
                            "t", gateway_s=0.0)
    for name in ("base_s", "prefill_token_s", "prefill_attention_s", "decode_seq_s",
                 "context_token_s"):
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=1e-6)


def test_multi_turn_sessions_share_the_system_prompt():
    config = WorkloadConfig(kind=WorkloadKind.MULTI_TURN, sessions=3, turns=4, system_len=20,
                            first_input_len=50, input_len=8, output_len=5)
    sessions = sim_sessions(config, 10, seed=0)
    assert [len(s) for s in sessions] == [4, 4, 2]  # capped at 10 requests
    assert sessions[0][0].system == sessions[2][0].system and len(sessions[0][0].system) == 20
    assert [len(t.user) for t in sessions[1]] == [50, 8, 8, 8]
    assert all(t.system is None for t in sessions[1][1:]) and IM_START < 10


def test_kv_aware_beats_round_robin_on_a_small_replay():
    workload = WorkloadConfig(kind=WorkloadKind.MULTI_TURN, sessions=12, turns=5,
                              system_len=64, first_input_len=256, input_len=32, output_len=16)
    load = LoadConfig(num_requests=60, rate=2.0, seed=1)
    runs = {r: simulate(SimConfig(num_workers=4, router=r, kv_blocks=512), CostModel(
        0.01, 0.001, 1e-6, 0.002, 1e-5), workload, load) for r in ("kv-aware", "round-robin")}
    kv, rr = runs["kv-aware"].metrics, runs["round-robin"].metrics
    assert kv.completed == rr.completed == 60 and kv.failed == 0
    assert kv.cached_token_ratio > rr.cached_token_ratio + 0.1
    assert kv.ttft_ms.p90 < rr.ttft_ms.p90
    assert sum(runs["round-robin"].requests_per_worker.values()) == 60
    again = simulate(SimConfig(num_workers=4, router="kv-aware", kv_blocks=512),
                     CostModel(0.01, 0.001, 1e-6, 0.002, 1e-5), workload, load)
    assert again.metrics == kv  # deterministic
