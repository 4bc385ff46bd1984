"""`kiln bench sim`: routing policies at 8-64 workers and thousands of requests, in seconds.

A discrete-event replay of a `kiln bench` workload through the *real* gateway-side code -- the
router (kiln.cluster.router), the KV index (kiln.cluster.kv_index) and the load tracker -- against
modeled workers. Each modeled worker runs the *real* engine bookkeeping (Scheduler and
KVCacheManager with prefix caching and KV events); only the model is replaced: a step takes
`CostModel.step_s(shape)` simulated seconds and samples a deterministic token per sequence.

The cost model (sim_cost.py) is fitted by `kiln bench sim-fit` to steps timed on a real
engine: step time is linear in prompt tokens, prompt attention, decoding sequences and context.
`--tensor-parallel-size T` models workers of T ranks (sim_tp.py: the step split T ways plus
two all-reduces per layer, a cost fitted to measured all-reduce latencies) beside TP = 1.

Prompts are token ids in the chat shape of the real runs (ChatML-style framing around each
message; replies feed the next turn), so cache hits match a real multi-turn run block for block.
Output: the metrics `kiln bench serve` computes (same definitions, kiln.bench.metrics), per run.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import time
import zlib
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from kiln.bench.config import SLO, LoadConfig, WorkloadConfig, WorkloadKind
from kiln.bench.metrics import BenchMetrics, RequestRecord, compute_metrics
from kiln.bench.sim_cost import BUILTIN, CostModel, fit_cost_model, model_error, step_shape
from kiln.bench.sim_tp import (
    BACKENDS,
    BUILTIN_ALL_REDUCE,
    DEFAULT_SHAPE,
    ModelShape,
    TensorParallelCost,
    fit_all_reduce,
)
from kiln.cluster.kv_index import KVIndex
from kiln.cluster.router import Candidate, LoadTracker, Router, make_policy
from kiln.config import CacheConfig, SchedulerConfig
from kiln.engine.contract import RunnerOutput
from kiln.engine.kv_manager import KVCacheManager
from kiln.engine.request import Request
from kiln.engine.scheduler import Scheduler, SchedulerOutput
from kiln.sampling_params import SamplingParams

IM_START, IM_END, NL = 1, 2, 3
ROLES = {"system": 4, "user": 5, "assistant": 6}
FIRST_CONTENT_ID, VOCAB = 10, 32000


# -- the workload as token ids ------------------------------------------------------------------

@dataclass(frozen=True)
class SimTurn:
    user: tuple[int, ...]  # the new message's content tokens
    output_len: int
    system: tuple[int, ...] | None = None  # a system message before it (first turns)


def message(role: str, content: Iterable[int]) -> list[int]:
    return [IM_START, ROLES[role], NL, *content, IM_END, NL]


def sim_sessions(config: WorkloadConfig, num_requests: int, seed: int) -> list[list[SimTurn]]:
    """The workload's sessions with synthetic content tokens (the shapes `kiln bench serve`
    sends: same lengths, same sharing of system prompts and prefixes)."""
    rng = np.random.default_rng(seed)

    def content(n: int) -> tuple[int, ...]:
        return tuple(rng.integers(FIRST_CONTENT_ID, VOCAB, n).tolist())

    def lengths(mean: int, n: int) -> list[int]:
        low = max(1, int(np.floor(mean * (1 - config.range_ratio))))
        high = max(low, int(np.ceil(mean * (1 + config.range_ratio))))
        return rng.integers(low, high + 1, size=n).tolist()

    kind = config.kind
    if kind in (WorkloadKind.RANDOM, WorkloadKind.LONG_CONTEXT):
        ins, outs = lengths(config.input_len, num_requests), lengths(config.output_len,
                                                                     num_requests)
        return [[SimTurn(content(i), o)] for i, o in zip(ins, outs, strict=True)]
    if kind is WorkloadKind.SHARED_PREFIX:
        return _shared_prefix(config, content, lengths, rng)[:num_requests]
    if kind is WorkloadKind.MULTI_TURN:
        return _cap(_multi_turn(config, content, lengths), num_requests)
    raise ValueError(f"kiln bench sim cannot replay the {kind.value} workload")


def _shared_prefix(config, content, lengths, rng) -> list[list[SimTurn]]:
    total = config.groups * config.prompts_per_group
    ins, outs = lengths(config.input_len, total), lengths(config.output_len, total)
    turns = []
    for _ in range(config.groups):
        prefix = content(config.system_len)
        for _ in range(config.prompts_per_group):
            k = len(turns)
            turns.append(SimTurn(content(ins[k]), outs[k], system=prefix))
    return [[turns[k]] for k in rng.permutation(total).tolist()]


def _multi_turn(config, content, lengths) -> list[list[SimTurn]]:
    system = content(config.system_len) if config.system_len else None
    sessions = []
    for _ in range(config.sessions):
        ins, outs = lengths(config.input_len, config.turns), lengths(config.output_len,
                                                                     config.turns)
        ins[0] = lengths(config.first_input_len, 1)[0]
        turns = [SimTurn(content(ins[0]), outs[0], system=system)]
        turns += [SimTurn(content(ins[t]), outs[t]) for t in range(1, config.turns)]
        sessions.append(turns)
    return sessions


def _cap(sessions: list[list[SimTurn]], limit: int) -> list[list[SimTurn]]:
    kept = []
    for turns in sessions:
        if limit <= 0:
            break
        kept.append(turns[:limit])
        limit -= len(kept[-1])
    return kept


# -- modeled workers --------------------------------------------------------------------------

@dataclass(frozen=True)
class SimConfig:
    num_workers: int = 16
    router: str = "kv-aware"
    router_temperature: float = 0.0
    prefill_weight: float = 1.0
    kv_blocks: int = 4096  # per worker
    block_size: int = 16
    max_model_len: int = 8192
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    overload_waiting: int = 64
    event_delay_s: float = 0.001  # worker step -> the gateway's index sees its KV events
    seed: int = 0
    tensor_parallel_size: int = 1  # ranks per worker (the cost model prices them)


class SimWorker:
    """The real scheduler and KV cache manager, with model time from the cost model."""

    def __init__(self, worker_id: str, config: SimConfig):
        self.worker_id = worker_id
        self.kv = KVCacheManager(CacheConfig(block_size=config.block_size), config.kv_blocks,
                                 emit_events=True)
        self.scheduler = Scheduler(SchedulerConfig(config.max_num_seqs,
                                                   config.max_num_batched_tokens),
                                   self.kv, config.max_model_len)
        self.stepping = False
        self.event_seq = 0
        self.num_requests = 0

    def step_outputs(self, sched: SchedulerOutput):
        tokens = [[_token(item.request_id, len(item.output_token_ids))] if item.samples else []
                  for item in sched.scheduled]
        return self.scheduler.update(sched, RunnerOutput(tokens))


def _token(request_id: str, position: int) -> int:
    return FIRST_CONTENT_ID + zlib.crc32(f"{request_id}:{position}".encode()) % (
        VOCAB - FIRST_CONTENT_ID)


@dataclass
class _Live:
    """A request in flight: what the client will record."""

    session: int
    turn: int
    prompt: list[int]
    sent: float
    worker: str
    tokens: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    cached: int = 0


class Simulation:
    """One run: event heap of (time, order, kind, payload)."""

    def __init__(self, config: SimConfig, cost: CostModel | TensorParallelCost,
                 sessions: list[list[SimTurn]], load: LoadConfig):
        self.config, self.cost, self.sessions, self.load = config, cost, sessions, load
        self.workers = {f"w{i}": SimWorker(f"w{i}", config) for i in range(config.num_workers)}
        self.index = KVIndex()
        for w in self.workers:
            self.index.add_worker(w)
            self.index.load_snapshot(w, 0, [])
        policy = make_policy(config.router, config.prefill_weight, config.router_temperature,
                             config.seed)
        self.router = Router(policy, self.index, LoadTracker(config.block_size))
        self.now = 0.0
        self._heap: list = []
        self._order = itertools.count()
        self.history: dict[int, list[int]] = {}
        self.live: dict[str, _Live] = {}
        self.records: list[RequestRecord] = []
        self.issued = 0

    def push(self, at: float, kind: str, payload) -> None:
        heapq.heappush(self._heap, (at, next(self._order), kind, payload))

    def run(self) -> list[RequestRecord]:
        self._schedule_sessions()
        handlers = {"send": self._send, "arrive": self._arrive, "step": self._step_done,
                    "events": self._events}
        while self._heap:
            self.now, _, kind, payload = heapq.heappop(self._heap)
            handlers[kind](payload)
        return self.records

    def _schedule_sessions(self) -> None:
        from kiln.bench.runner import arrival_offsets

        if self.load.concurrency is not None:
            self._queue = iter(range(len(self.sessions)))
            for _ in range(self.load.concurrency):
                self._next_session()
            return
        rng = np.random.default_rng([self.load.seed, 1])
        for sid, at in enumerate(arrival_offsets(len(self.sessions), self.load.rate,
                                                 self.load.burstiness, rng)):
            self.push(at, "send", (sid, 0))

    def _next_session(self) -> None:
        sid = next(self._queue, None)
        if sid is not None:
            self.push(self.now, "send", (sid, 0))

    # -- the client and the gateway -----------------------------------------------------------

    def _send(self, key: tuple[int, int]) -> None:
        sid, turn_index = key
        if self.issued >= self.load.num_requests:
            return
        self.issued += 1
        turn = self.sessions[sid][turn_index]
        prompt = list(self.history.get(sid, []))
        if turn.system is not None:
            prompt += message("system", turn.system)
        prompt += message("user", turn.user) + [IM_START, ROLES["assistant"], NL]
        rid = f"s{sid}t{turn_index}"
        candidates = [Candidate(w.worker_id, w.scheduler.num_waiting >= self.config.overload_waiting)
                      for w in self.workers.values()]
        decision = self.router.route(rid, prompt, None, candidates)
        self.live[rid] = _Live(sid, turn_index, prompt, self.now, decision.chosen)
        request = Request(rid, prompt, SamplingParams(max_tokens=turn.output_len, temperature=0,
                                                      ignore_eos=True), arrival_time=self.now)
        self.push(self.now + self.cost.gateway_s, "arrive", (decision.chosen, request))

    def _arrive(self, payload: tuple[str, Request]) -> None:
        worker_id, request = payload
        worker = self.workers[worker_id]
        worker.scheduler.add_request(request)
        worker.num_requests += 1
        self._maybe_step(worker)

    def _maybe_step(self, worker: SimWorker) -> None:
        if worker.stepping or not worker.scheduler.has_work():
            return
        sched = worker.scheduler.schedule()
        worker.stepping = True
        self.push(self.now + self.cost.step_s(step_shape(sched)), "step", (worker, sched))

    def _step_done(self, payload: tuple[SimWorker, SchedulerOutput]) -> None:
        worker, sched = payload
        worker.stepping = False
        for out in worker.step_outputs(sched):
            self._on_output(out)
        events = worker.kv.prefix_cache.take_events()
        if events:
            worker.event_seq += 1
            self.push(self.now + self.config.event_delay_s, "events",
                      (worker.worker_id, worker.event_seq, events))
        self._maybe_step(worker)

    def _events(self, payload) -> None:
        self.index.apply(*payload)

    def _on_output(self, out) -> None:
        live = self.live.get(out.request_id)
        if live is None:
            return
        if out.new_token_ids:
            if not live.tokens:
                live.cached = out.num_cached_tokens
            live.tokens += out.new_token_ids
            live.times += [self.now] * len(out.new_token_ids)
            self.router.loads.progressed(out.request_id, len(out.new_token_ids))
        if out.finished:
            self._finish(out.request_id, live)

    def _finish(self, rid: str, live: _Live) -> None:
        del self.live[rid]
        self.router.loads.release(rid)
        first = live.times[0] + self.cost.gateway_s  # the client sees it after the gateway
        itl = tuple(np.diff(live.times).tolist())
        self.records.append(RequestRecord(
            request_id=len(self.records), session_id=live.session, turn=live.turn,
            start_s=live.sent, max_tokens=len(live.tokens),
            expected_prompt_tokens=len(live.prompt), ttft_s=first - live.sent,
            e2e_s=live.times[-1] + self.cost.gateway_s - live.sent, itl_s=itl,
            prompt_tokens=len(live.prompt), output_tokens=len(live.tokens),
            cached_tokens=live.cached))
        self.history[live.session] = live.prompt + live.tokens + [IM_END, NL]
        if live.turn + 1 < len(self.sessions[live.session]):
            self.push(self.now + self.cost.gateway_s, "send", (live.session, live.turn + 1))
        elif self.load.concurrency is not None:
            self._next_session()


@dataclass(frozen=True)
class SimResult:
    config: SimConfig
    metrics: BenchMetrics
    records: tuple[RequestRecord, ...]
    requests_per_worker: dict[str, int]
    wall_s: float  # how long the simulation itself took


def simulate(config: SimConfig, cost: CostModel | TensorParallelCost, workload: WorkloadConfig,
             load: LoadConfig) -> SimResult:
    started = time.perf_counter()
    sessions = sim_sessions(workload, load.num_requests, load.seed)
    sim = Simulation(config, cost, sessions, load)
    records = sim.run()
    duration = max((r.start_s + (r.e2e_s or 0) for r in records), default=0.0)
    metrics = compute_metrics(records, duration, SLO())
    per_worker = {w.worker_id: w.num_requests for w in sim.workers.values()}
    return SimResult(config, metrics, tuple(records), per_worker, time.perf_counter() - started)


# -- CLI ----------------------------------------------------------------------------------------

def register(sub: argparse._SubParsersAction) -> None:
    from kiln.bench.cli import _add_load_args, _add_workload_args

    p = sub.add_parser("sim", help="simulate routing policies over many modeled workers",
                       description="Replay a workload through the real router and KV index "
                                   "against modeled workers (no model, no server).")
    p.add_argument("--workers", type=int, nargs="+", default=[16], help="worker counts")
    p.add_argument("--router", nargs="+", default=["kv-aware", "round-robin"],
                   choices=["round-robin", "least-load", "kv-aware"])
    p.add_argument("--router-temperature", type=float, default=0.0)
    p.add_argument("--prefill-weight", type=float, default=1.0)
    p.add_argument("--kv-blocks", type=int, default=SimConfig.kv_blocks, help="per worker")
    p.add_argument("--max-num-seqs", type=int, default=SimConfig.max_num_seqs)
    p.add_argument("--max-num-batched-tokens", type=int,
                   default=SimConfig.max_num_batched_tokens)
    p.add_argument("--cost-model", type=Path, help="JSON from `kiln bench sim-fit` "
                   "(default: a built-in fit of SmolLM2-135M on 1 thread)")
    p.add_argument("--tensor-parallel-size", type=int, nargs="+", default=[1],
                   help="ranks per worker; TP = 1 runs too, as the baseline (sim_tp.py)")
    p.add_argument("--all-reduce", choices=BACKENDS, default="shm",
                   help="the TP all-reduce: shm (one machine) or gloo (across machines)")
    p.add_argument("--all-reduce-results", type=Path, help="benchmarks/allreduce.py JSON to "
                   "fit the all-reduce cost to (default: a built-in fit of its recorded run)")
    p.add_argument("--model-shape", type=_model_shape, default=DEFAULT_SHAPE,
                   metavar="LAYERS,HIDDEN,KV_HEADS[,DTYPE_BYTES]",
                   help="the modeled model's shape for TP (default: SmolLM2-135M, "
                        "30,576,3,2, the built-in cost model's)")
    p.add_argument("--out", type=Path, help="write every run's metrics as JSON here")
    _add_workload_args(p)
    _add_load_args(p)
    p.set_defaults(func=_run_cli)
    f = sub.add_parser("sim-fit", help="fit the simulator's cost model to a real engine",
                       description="Time engine steps of many shapes and fit the step cost.")
    f.add_argument("--model", default=None, help="HF checkpoint dir (default: bundled)")
    f.add_argument("--dtype", default="auto")
    f.add_argument("--threads", type=int, default=1)
    f.add_argument("--out", type=Path, required=True, help="cost model JSON to write")
    f.set_defaults(func=_fit_cli)


def _run_cli(args: argparse.Namespace) -> int:
    from kiln.bench.cli import load_from_args, workload_from_args

    workload = workload_from_args(args)
    load = load_from_args(args, workload)
    cost = CostModel.load(args.cost_model) if args.cost_model else BUILTIN
    all_reduce = (fit_all_reduce(args.all_reduce_results, args.all_reduce)
                  if args.all_reduce_results else BUILTIN_ALL_REDUCE[args.all_reduce])
    rows = []
    for n in args.workers:
        for router in args.router:
            baseline = None
            for tp in sorted({1, *args.tensor_parallel_size}):
                tp_cost = TensorParallelCost(cost, tp, all_reduce, args.model_shape)
                config = SimConfig(num_workers=n, router=router,
                                   router_temperature=args.router_temperature,
                                   prefill_weight=args.prefill_weight,
                                   kv_blocks=tp_cost.kv_blocks(args.kv_blocks),
                                   max_num_seqs=args.max_num_seqs,
                                   max_num_batched_tokens=args.max_num_batched_tokens,
                                   seed=args.seed, tensor_parallel_size=tp)
                result = simulate(config, cost if tp == 1 else tp_cost, workload, load)
                rows.append(summary_row(result))
                baseline = baseline or rows[-1]
                print(format_row(rows[-1]) + versus(rows[-1], baseline), flush=True)
    if args.out:
        args.out.write_text(json.dumps({"cost_model": asdict(cost), "workload":
                                        _jsonable(workload), "load": _jsonable(load),
                                        "runs": rows}, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0


def summary_row(result: SimResult) -> dict:
    m = result.metrics
    return {"workers": result.config.num_workers, "router": result.config.router,
            "tensor_parallel_size": result.config.tensor_parallel_size,
            "requests": m.completed, "cached_token_ratio": m.cached_token_ratio,
            "tpot_p50_ms": m.tpot_ms.p50 if m.tpot_ms is not None else None,
            "ttft_p50_ms": m.ttft_ms.p50, "ttft_p90_ms": m.ttft_ms.p90,
            "ttft_p99_ms": m.ttft_ms.p99, "e2e_p50_ms": m.e2e_ms.p50,
            "output_tok_s": m.output_throughput, "duration_s": m.duration_s,
            "max_worker_share": max(result.requests_per_worker.values()) / max(m.completed, 1),
            "sim_wall_s": result.wall_s}


def format_row(r: dict) -> str:
    tp = r.get("tensor_parallel_size", 1)
    return ((f"TP={tp} " if tp > 1 else "") +
            f"{r['workers']:>3} workers {r['router']:<12} {r['requests']:>5} req  "
            f"cached {r['cached_token_ratio']:.3f}  TTFT p50 {r['ttft_p50_ms']:8.1f} ms  "
            f"p90 {r['ttft_p90_ms']:8.1f} ms  out {r['output_tok_s']:8.1f} tok/s  "
            f"busiest worker {r['max_worker_share']:.0%}  ({r['sim_wall_s']:.1f} s to simulate)")


def versus(row: dict, baseline: dict) -> str:
    """A TP row against the same run at TP = 1: TPOT and output throughput ratios."""
    if row is baseline or not row.get("tpot_p50_ms") or not baseline.get("tpot_p50_ms"):
        return ""
    return (f"  | vs TP=1: TPOT p50 {row['tpot_p50_ms']:.2f} ms "
            f"(x{row['tpot_p50_ms'] / baseline['tpot_p50_ms']:.2f}), output throughput "
            f"x{row['output_tok_s'] / max(baseline['output_tok_s'], 1e-9):.2f}")


def _model_shape(text: str) -> ModelShape:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        values = []
    if len(values) not in (3, 4) or min(values) < 1:
        raise argparse.ArgumentTypeError(f"--model-shape wants LAYERS,HIDDEN,KV_HEADS"
                                         f"[,DTYPE_BYTES] of positive integers, got {text!r}")
    return ModelShape(*values)


def _jsonable(value) -> dict:
    import msgspec
    return msgspec.to_builtins(value)


def _fit_cli(args: argparse.Namespace) -> int:
    from kiln.bench.sim_cost import measure_steps

    samples, source = measure_steps(args.model, args.dtype, args.threads)
    model = fit_cost_model(samples, source)
    model.save(args.out)
    args.out.with_suffix(".samples.json").write_text(json.dumps(
        [[*asdict(shape).values(), seconds] for shape, seconds in samples]) + "\n")
    print(f"{len(samples)} steps measured; median error of the fit "
          f"{model_error(model, samples):.1%}; wrote {args.out}")
    return 0
