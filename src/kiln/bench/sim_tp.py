"""Tensor parallelism in the simulator: a worker of T ranks, each with 1/T of every layer.

A step at TP = T costs the fitted single-process step (sim_cost.CostModel, whose threads each
rank has) divided by T, since weights, FLOPs and KV heads split T ways, plus two all-reduces
of the step's `[tokens, hidden]` activations per decoder layer (after o_proj and down_proj):

    step_s(T) = step_s(1) / T + 2 x layers x all_reduce(tokens x hidden x dtype bytes, T)

Everything else a TP step adds (the step broadcast, the logits gather) and what it cannot
split (a fixed per-step overhead in `base_s`) is left out, so the prediction is optimistic:
a bound for a machine whose memory bandwidth grows with its cores.

The all-reduce cost is a line fitted at 2 ranks to the per-call latencies of
`benchmarks/allreduce.py` (benchmarks/results/allreduce.json: one token's and 64 tokens'
hidden state of the default model), scaled to T ranks by how each backend moves the bytes:

- shm (kiln's shared-memory all-reduce, one machine): every rank publishes its slot, waits for
  the T - 1 others and sums all T slots: T - 1 waits, T slots read (T / 2 times the 2-rank
  bytes);
- gloo (TCP, across machines; a ring): T - 1 neighbour exchanges, each rank moving
  2 (T - 1) / T of the tensor.

Both equal the measured line at T = 2 and grow with T. The KV cache: each rank holds its share
of the KV heads, so a worker's blocks grow T-fold in the same bytes per rank, up to the
model's KV head count (past it a head is replicated).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kiln.bench.sim_cost import CostModel, StepShape

BACKENDS = ("shm", "gloo")


@dataclass(frozen=True)
class AllReduceCost:
    """One all-reduce call: `sync_s` per rank waited for and `per_byte_s` per byte, the line
    measured at 2 ranks (see the module docstring for T ranks)."""

    backend: str
    sync_s: float
    per_byte_s: float
    source: str = ""

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"all-reduce backend {self.backend!r}: one of {BACKENDS}")

    def call_s(self, nbytes: float, ranks: int) -> float:
        if ranks < 1:
            raise ValueError(f"ranks must be >= 1, got {ranks}")
        if ranks == 1:
            return 0.0
        volume = ranks / 2 if self.backend == "shm" else 2 * (ranks - 1) / ranks
        return self.sync_s * (ranks - 1) + self.per_byte_s * nbytes * volume


# fit_all_reduce(benchmarks/results/allreduce.json, backend, "bfloat16"), 2 ranks, this
# project's 2-vCPU box (tests/unit/test_sim_tp.py checks these against the file)
BUILTIN_ALL_REDUCE = {
    "shm": AllReduceCost("shm", sync_s=6.0352e-6, per_byte_s=1.6038e-10,
                         source="allreduce.json: shm bf16, 2 ranks"),
    "gloo": AllReduceCost("gloo", sync_s=411.10e-6, per_byte_s=0.0,
                          source="allreduce.json: gloo bf16, 2 ranks (loopback)"),
}


def fit_all_reduce(path: Path, backend: str, dtype: str = "bfloat16") -> AllReduceCost:
    """The least-squares line latency = sync + per_byte x bytes through the file's 2-rank
    median latencies of `backend` in `dtype`."""
    result = json.loads(Path(path).read_text())
    if result.get("world_size") != 2:
        raise ValueError(f"{path}: measured at world_size {result.get('world_size')}; the fit "
                         f"needs 2 ranks")
    rows = [r for r in result["rows"] if r["backend"] == backend and r["dtype"] == dtype]
    if len(rows) < 2:
        raise ValueError(f"{path}: {len(rows)} {backend} {dtype} rows; the fit needs 2 sizes")
    nbytes = np.array([r["bytes"] for r in rows], dtype=float)
    seconds = np.array([r["median_us"] for r in rows]) * 1e-6
    per_byte, sync = np.polyfit(nbytes, seconds, 1)
    return AllReduceCost(backend, float(max(sync, 0.0)), float(max(per_byte, 0.0)),
                         f"{Path(path).name}: {backend} {dtype}, 2 ranks")


@dataclass(frozen=True)
class ModelShape:
    """What the TP cost needs of the model: its all-reduce count and size, its KV heads."""

    num_layers: int = 30
    hidden_size: int = 576
    num_kv_heads: int = 3
    dtype_bytes: int = 2


DEFAULT_SHAPE = ModelShape()  # SmolLM2-135M bf16, the builtin cost model's


@dataclass(frozen=True)
class TensorParallelCost:
    """The step cost of a worker of `tp_size` ranks (what Simulation asks of a cost model:
    `step_s` and `gateway_s`)."""

    base: CostModel
    tp_size: int
    all_reduce: AllReduceCost
    shape: ModelShape = DEFAULT_SHAPE

    def __post_init__(self) -> None:
        if self.tp_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tp_size}")

    @property
    def gateway_s(self) -> float:
        return self.base.gateway_s

    def step_s(self, shape: StepShape) -> float:
        return self.compute_s(shape) + self.communication_s(shape)

    def compute_s(self, shape: StepShape) -> float:
        return self.base.step_s(shape) / self.tp_size

    def communication_s(self, shape: StepShape) -> float:
        """Two all-reduces per layer of the step's [tokens, hidden] activations."""
        tokens = shape.prefill_tokens + shape.decode_seqs
        nbytes = tokens * self.shape.hidden_size * self.shape.dtype_bytes
        return 2 * self.shape.num_layers * self.all_reduce.call_s(nbytes, self.tp_size)

    def kv_blocks(self, per_rank: int) -> int:
        """A worker's KV blocks when each rank holds `per_rank` blocks of its heads: the heads
        split T ways, each rank keeping at least one (replicated past the model's)."""
        heads = self.shape.num_kv_heads
        return per_rank * heads // math.ceil(heads / self.tp_size)


# -- the model-size crossover (benchmarks/tp_crossover.py) ------------------------------------
#
# Batch-b decode streams every weight once per step, so a dense layer of hidden size h
# (q, k, v, o: 4 h^2; a SwiGLU MLP of 8/3 h: 8 h^2) costs its bytes over the bandwidth its
# cores reach. On C cores:
#
#     one process:  12 h^2 d / (C bw e_one)
#     TP = T:       12 h^2 d / (C bw e_rank) + 2 all_reduce(b h d, T)
#
# (bw: one core's share of the measured read bandwidth; e: the fraction of it a decode
# reaches, measured, for one process with all C cores' threads and for a rank with C / T;
# d: bytes per weight). TP wins per layer where a h^2 >= c1 h + c0, with
# a = 12 d (1 / e_one - 1 / e_rank) / (C bw) and the all-reduce's c1 h + c0: never where a
# rank streams no faster per core than one process (e_rank <= e_one). The layer count drops
# out; `family_params` names a hidden size's model (a Llama-shaped family, h / 128 layers).


@dataclass(frozen=True)
class DecodeRates:
    """Measured decode rates: bytes per second one core's share of the machine's read
    bandwidth is, and the fraction of it one process's and one rank's decode reach."""

    core_bandwidth_bps: float
    one_process_efficiency: float
    rank_efficiency: float


def layer_params(hidden: float) -> float:
    """A dense decoder layer's weights: attention 4 h^2 (as many KV as query heads: an upper
    bound) and a SwiGLU MLP of 8/3 h, 8 h^2."""
    return 12 * hidden * hidden


def family_params(hidden: float) -> float:
    """A Llama-shaped model of hidden size h: h / 128 layers (Llama-2 7B: 4096, 32 layers)."""
    return max(1.0, hidden / 128) * layer_params(hidden)


def crossover_hidden(ranks: int, rates: DecodeRates, all_reduce: AllReduceCost,
                     batch: int = 1, dtype_bytes: int = 2,
                     cores: int | None = None) -> float | None:
    """The hidden size above which TP = `ranks` decodes a layer faster than one process on
    the same `cores` (default: one per rank); None: at no size (see the comment above)."""
    cores = cores or ranks
    gain = 1 / rates.one_process_efficiency - 1 / rates.rank_efficiency
    a = 12 * dtype_bytes * gain / (cores * rates.core_bandwidth_bps)
    if a <= 0:
        return None
    # the 2 all-reduces of [batch, h] per layer: c0 + c1 h
    c0 = 2 * all_reduce.call_s(0, ranks)
    c1 = 2 * (all_reduce.call_s(batch * dtype_bytes, ranks) - all_reduce.call_s(0, ranks))
    return (c1 + math.sqrt(c1 * c1 + 4 * a * c0)) / (2 * a)


def layer_step_s(hidden: float, ranks: int, rates: DecodeRates, all_reduce: AllReduceCost,
                 batch: int = 1, dtype_bytes: int = 2, cores: int | None = None) -> float:
    """One layer's batch-`batch` decode time at TP = `ranks` (1: one process) on `cores`
    cores (default: one per rank)."""
    cores = cores or ranks
    efficiency = rates.one_process_efficiency if ranks == 1 else rates.rank_efficiency
    stream_s = layer_params(hidden) * dtype_bytes / (cores * rates.core_bandwidth_bps
                                                     * efficiency)
    return stream_s + 2 * all_reduce.call_s(batch * hidden * dtype_bytes, ranks)
