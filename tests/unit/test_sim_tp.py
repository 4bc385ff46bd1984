"""The simulator's tensor-parallel step cost and the model-size crossover arithmetic
(kiln.bench.sim_tp), to exact values."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln.bench.config import LoadConfig, WorkloadConfig, WorkloadKind
from kiln.bench.sim import SimConfig, simulate
from kiln.bench.sim_cost import BUILTIN, StepShape
from kiln.bench.sim_tp import (
    BUILTIN_ALL_REDUCE,
    AllReduceCost,
    DecodeRates,
    ModelShape,
    TensorParallelCost,
    crossover_hidden,
    fit_all_reduce,
    layer_step_s,
)

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "allreduce.json"
SHM = AllReduceCost("shm", sync_s=5e-6, per_byte_s=1e-9)
GLOO = AllReduceCost("gloo", sync_s=200e-6, per_byte_s=2e-9)
SHAPES = [StepShape(decode_seqs=1, context_tokens=100), StepShape(decode_seqs=64,
          context_tokens=64 * 500), StepShape(prefill_tokens=512, prefill_attention=131072.0)]


def test_one_rank_costs_the_fitted_step():
    for shape in SHAPES:
        assert TensorParallelCost(BUILTIN, 1, SHM).step_s(shape) == BUILTIN.step_s(shape)


def test_two_all_reduces_per_layer_of_the_steps_activations():
    shape = StepShape(prefill_tokens=10, decode_seqs=6)  # 16 tokens
    cost = TensorParallelCost(BUILTIN, 4, SHM, ModelShape(num_layers=7, hidden_size=100,
                                                          num_kv_heads=4, dtype_bytes=2))
    # shm at 4 ranks: 3 waits, every rank reads 4 slots (2x the 2-rank bytes)
    call = 3 * 5e-6 + 1e-9 * (16 * 100 * 2) * 2
    assert cost.communication_s(shape) == pytest.approx(2 * 7 * call, rel=1e-12)
    assert cost.step_s(shape) == pytest.approx(BUILTIN.step_s(shape) / 4 + 14 * call)


def test_all_reduce_cost_is_the_measured_line_at_two_ranks_and_grows_with_ranks():
    for cost in (SHM, GLOO):
        assert cost.call_s(1000, 1) == 0.0
        assert cost.call_s(1000, 2) == pytest.approx(cost.sync_s + cost.per_byte_s * 1000)
        calls = [cost.call_s(1000, t) for t in (2, 4, 8, 16)]
        assert calls == sorted(calls) and len(set(calls)) == 4
        assert cost.call_s(2000, 8) > cost.call_s(1000, 8)
    # a ring moves 2 (T - 1) / T of the tensor per rank
    assert GLOO.call_s(1000, 4) == pytest.approx(3 * 200e-6 + 2e-9 * 1000 * 1.5)
    with pytest.raises(ValueError, match="all-reduce backend 'nccl'"):
        AllReduceCost("nccl", 0.0, 0.0)


def test_tensor_parallel_step_falls_with_ranks_while_compute_dominates():
    shape = StepShape(decode_seqs=1, context_tokens=100)
    steps = [TensorParallelCost(BUILTIN, t, BUILTIN_ALL_REDUCE["shm"]).step_s(shape)
             for t in (1, 2, 4, 8)]
    assert steps == sorted(steps, reverse=True)
    # over gloo 60 calls of ~0.2 ms each outweigh the halved 16 ms step at 8 ranks
    gloo = TensorParallelCost(BUILTIN, 8, BUILTIN_ALL_REDUCE["gloo"])
    assert gloo.communication_s(shape) > gloo.compute_s(shape)


def test_builtin_all_reduce_costs_are_the_recorded_fit():
    for backend, builtin in BUILTIN_ALL_REDUCE.items():
        fitted = fit_all_reduce(RESULTS, backend)
        assert fitted.sync_s == pytest.approx(builtin.sync_s, rel=1e-3)
        assert fitted.per_byte_s == pytest.approx(builtin.per_byte_s, rel=1e-3)


def test_kv_blocks_grow_with_the_ranks_up_to_the_kv_heads():
    shape = ModelShape(num_kv_heads=4)
    blocks = [TensorParallelCost(BUILTIN, t, SHM, shape).kv_blocks(100) for t in (1, 2, 4, 8)]
    assert blocks == [100, 200, 400, 400]


def test_simulated_workers_of_two_ranks_decode_faster():
    workload = WorkloadConfig(kind=WorkloadKind.RANDOM, input_len=32, output_len=16)
    load = LoadConfig(concurrency=2, num_requests=4)
    config = SimConfig(num_workers=1, kv_blocks=256)
    one = simulate(config, BUILTIN, workload, load).metrics
    two = simulate(config, TensorParallelCost(BUILTIN, 2, BUILTIN_ALL_REDUCE["shm"]),
                   workload, load).metrics
    assert two.tpot_ms.p50 < one.tpot_ms.p50


RATES = DecodeRates(core_bandwidth_bps=10e9, one_process_efficiency=0.8, rank_efficiency=1.0)


def test_crossover_is_where_the_layer_times_meet():
    for ranks, cost, batch in [(2, SHM, 1), (4, SHM, 64), (8, GLOO, 1)]:
        h = crossover_hidden(ranks, RATES, cost, batch)
        one = layer_step_s(h, 1, RATES, cost, batch, cores=ranks)
        assert layer_step_s(h, ranks, RATES, cost, batch) == pytest.approx(one, rel=1e-9)
        assert layer_step_s(2 * h, ranks, RATES, cost, batch) < layer_step_s(
            2 * h, 1, RATES, cost, batch, cores=ranks)
        assert layer_step_s(h / 2, ranks, RATES, cost, batch) > layer_step_s(
            h / 2, 1, RATES, cost, batch, cores=ranks)


def test_crossover_by_hand():
    # T = 2, shm, batch 1, bf16: a = 24 (1/0.8 - 1) / (2 x 10e9) = 3e-10 s per h^2;
    # the 2 all-reduces: c0 = 2 x 5e-6 = 1e-5 s, c1 = 2 x 1e-9 x 2 bytes = 4e-9 s per h
    a, c0, c1 = 3e-10, 1e-5, 4e-9
    expected = (c1 + (c1 * c1 + 4 * a * c0) ** 0.5) / (2 * a)
    assert crossover_hidden(2, RATES, SHM) == pytest.approx(expected, rel=1e-12)
    # more cores per rank shrink the streaming a TP step saves: the crossover grows
    assert crossover_hidden(2, RATES, SHM, cores=8) > expected


def test_no_crossover_where_a_rank_streams_no_faster_than_one_process():
    equal = DecodeRates(core_bandwidth_bps=10e9, one_process_efficiency=0.9,
                        rank_efficiency=0.9)
    assert crossover_hidden(2, equal, SHM) is None
