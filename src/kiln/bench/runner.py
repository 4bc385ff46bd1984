"""`run_benchmark(config) -> BenchResult`: warm up, release the workload's sessions under the
load shape, collect one record per request, and compute the metrics.

Sessions are released either at gamma-distributed arrival times (rate mode) or as a fixed
number in flight (concurrency mode). Within a session, turns run one after another and each
turn resends the whole conversation, including the real reply to the previous turn. The run
stops issuing after `num_requests` requests; at `max_duration_s` it cancels what is in flight
and records those requests as "cancelled".
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import numpy as np

from kiln.bench.client import RequestSpec, StreamingClient, StreamResult, make_http_client
from kiln.bench.config import BenchConfig, LoadConfig
from kiln.bench.metrics import ErrorKind, RequestRecord, compute_metrics
from kiln.bench.report import progress_bar
from kiln.bench.result import SCHEMA, BenchResult, Environment
from kiln.bench.tokens import (
    TextMaker,
    Tokenizer,
    count_tokens,
    load_tokenizer,
    resolve_tokenizer_path,
)
from kiln.bench.workloads import Message, Session, build_workload

WARMUP_INPUT_LEN = 16
WARMUP_OUTPUT_LEN = 8


class BenchError(RuntimeError):
    """The run could not start (e.g. the server is unreachable); the message says why."""


@dataclass(frozen=True)
class RunOptions:
    """How to run, beside what to run (`BenchConfig`); none of it is recorded."""

    tokenizer: Tokenizer | None = None  # loaded from config.tokenizer (or the model) if None
    api_key: str | None = None  # sent as a Bearer token
    show_progress: bool = False  # a rich progress bar on stderr


def run_benchmark(config: BenchConfig, options: RunOptions | None = None) -> BenchResult:
    """Run `config` against its server and return the result (records sorted by request id)."""
    options = options or RunOptions()
    tokenizer = options.tokenizer or load_tokenizer(
        resolve_tokenizer_path(config.tokenizer, config.server.model))
    workload = build_workload(config.workload, config.load.num_requests, config.load.seed,
                              tokenizer)
    records, duration = asyncio.run(_run(config, workload.sessions, tokenizer, options))
    records.sort(key=lambda r: r.request_id)
    return BenchResult(SCHEMA, config, Environment.capture(),
                       compute_metrics(records, duration, config.slo), tuple(records))


async def _run(config: BenchConfig, sessions: Sequence[Session], tokenizer: Tokenizer,
               options: RunOptions) -> tuple[list[RequestRecord], float]:
    headers = {"Authorization": f"Bearer {options.api_key}"} if options.api_key else {}
    counter = partial(count_tokens, tokenizer)
    async with make_http_client(config.server) as http:
        warm = StreamingClient(http, config.server, counter, time.perf_counter(), headers)
        await _warm_up(warm, tokenizer, config.load)
        total = sum(len(s.turns) for s in sessions)
        with progress_bar(options.show_progress, total,
                          f"{config.workload.kind.value} {config.load.describe()}") as advance:
            client = StreamingClient(http, config.server, counter, time.perf_counter(), headers)
            run = _Run(client, config.load, advance)
            return await run.execute(sessions)


async def _warm_up(client: StreamingClient, tokenizer: Tokenizer, load: LoadConfig) -> None:
    """Untimed short requests first (connections, lazy compilation); all failing aborts."""
    if load.warmup_requests == 0:
        return
    maker = TextMaker(tokenizer, np.random.default_rng([load.seed, 7]))
    specs = [RequestSpec(i, i, 0, (Message("user", maker.text(WARMUP_INPUT_LEN)),),
                         WARMUP_OUTPUT_LEN, WARMUP_INPUT_LEN)
             for i in range(load.warmup_requests)]
    results: list[StreamResult] = await asyncio.gather(*(client.send(s) for s in specs))
    failures = [r.record for r in results if not r.record.ok]
    if len(failures) == len(results):
        first = failures[0]
        raise BenchError(f"warm-up request to {client.server.url} failed: {first.error}: "
                         f"{first.error_detail}")


def arrival_offsets(n: int, rate: float | None, burstiness: float,
                    rng: np.random.Generator) -> list[float]:
    """Send times (s from the start) of n arrivals: the first at 0, then gamma gaps with mean
    1/rate and shape `burstiness` (1 = Poisson). rate None sends all at once."""
    if rate is None or n == 0:
        return [0.0] * n
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n - 1)
    return [0.0, *np.cumsum(gaps).tolist()]


class _Run:
    """The mutable state of one run: requests issued, records collected, requests in flight."""

    def __init__(self, client: StreamingClient, load: LoadConfig, on_record: Callable[[], None]):
        self.client = client
        self.load = load
        self.on_record = on_record
        self.issued = 0
        self.records: list[RequestRecord] = []
        self.in_flight: dict[int, tuple[RequestSpec, float]] = {}

    async def execute(self, sessions: Sequence[Session]) -> tuple[list[RequestRecord], float]:
        try:
            await asyncio.wait_for(self._drive(sessions), self.load.max_duration_s)
        except asyncio.TimeoutError:
            self._cancel_in_flight()
        return self.records, time.perf_counter() - self.client.clock_zero

    async def _drive(self, sessions: Sequence[Session]) -> None:
        if self.load.concurrency is not None:
            await self._closed_loop(sessions, self.load.concurrency)
        else:
            rng = np.random.default_rng([self.load.seed, 1])
            offsets = arrival_offsets(len(sessions), self.load.rate, self.load.burstiness, rng)
            await self._open_loop(sessions, offsets)

    async def _open_loop(self, sessions: Sequence[Session], offsets: list[float]) -> None:
        tasks: list[asyncio.Task[None]] = []
        try:
            for session, offset in zip(sessions, offsets, strict=True):
                delay = self.client.clock_zero + offset - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(self._session(session)))
            await asyncio.gather(*tasks)
        finally:  # cancelled at the deadline: stop the sessions already started, too
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _closed_loop(self, sessions: Sequence[Session], concurrency: int) -> None:
        queue = iter(sessions)  # shared by the workers; safe on one event loop

        async def worker() -> None:
            for session in queue:
                await self._session(session)

        await asyncio.gather(*(worker() for _ in range(concurrency)))

    async def _session(self, session: Session) -> None:
        """Turns in order; each sends the conversation so far. A failed turn ends the session."""
        history: list[Message] = []
        tokens = 0
        for turn_index, turn in enumerate(session.turns):
            if self.issued >= self.load.num_requests:
                return
            history.extend(turn.messages)
            tokens += turn.input_tokens
            spec = RequestSpec(self.issued, session.session_id, turn_index, tuple(history),
                               turn.output_len, tokens)
            self.issued += 1
            result = await self._send(spec)
            if not result.record.ok:
                return
            history.append(Message("assistant", result.text))
            tokens += result.record.output_tokens or 0

    async def _send(self, spec: RequestSpec) -> StreamResult:
        self.in_flight[spec.request_id] = (spec, time.perf_counter())
        result = await self.client.send(spec)
        del self.in_flight[spec.request_id]
        self.records.append(result.record)
        self.on_record()
        return result

    def _cancel_in_flight(self) -> None:
        for spec, sent_at in self.in_flight.values():
            self.records.append(RequestRecord(
                request_id=spec.request_id, session_id=spec.session_id, turn=spec.turn,
                start_s=sent_at - self.client.clock_zero, max_tokens=spec.max_tokens,
                expected_prompt_tokens=spec.expected_prompt_tokens, error=ErrorKind.CANCELLED,
                error_detail="still running at --max-duration"))
        self.in_flight.clear()
