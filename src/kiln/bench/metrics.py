"""Per-request records and the run's metrics, defined as vLLM's `bench serve` defines them.

- TTFT: request sent -> first streamed chunk carrying content.
- ITL: every gap between consecutive content chunks (all requests pooled).
- E2E latency: request sent -> last content chunk.
- TPOT: (e2e - TTFT) / (output tokens - 1), for requests with more than one output token;
  for goodput a one-token request counts as TPOT 0.
- Throughputs divide completed requests and their tokens by the run's duration (first request
  sent -> last request finished). Goodput counts only requests meeting every SLO set.
- Cached-token ratio: cached prompt tokens / prompt tokens over requests that reported
  `usage.prompt_tokens_details.cached_tokens`.
"""

from __future__ import annotations

import random
import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kiln.bench.config import SLO


class ErrorKind:
    """Error type names in records and summaries (HTTP errors are `http_<status>`)."""

    TIMEOUT = "timeout"
    CONNECTION = "connection"  # refused, reset or closed mid-response
    PROTOCOL = "protocol"  # any other HTTP client failure (bad encoding, redirects)
    SSE_ERROR = "sse_error"  # an error event inside a 200 stream
    BAD_CHUNK = "bad_chunk"  # a data line that is not JSON
    INCOMPLETE = "incomplete_stream"  # the stream closed before `data: [DONE]`
    NO_OUTPUT = "no_output"  # a finished stream with no content
    CANCELLED = "cancelled"  # still running at --max-duration

    @staticmethod
    def http(status: int) -> str:
        return f"http_{status}"


@dataclass(frozen=True)
class RequestRecord:
    """One request's timings (seconds) and token counts. `error` is None when it succeeded."""

    request_id: int
    session_id: int
    turn: int
    start_s: float  # when it was sent, from the start of the run
    max_tokens: int
    expected_prompt_tokens: int  # tokens of the prompt text as the workload sized it
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: tuple[float, ...] = ()
    prompt_tokens: int | None = None  # usage.prompt_tokens
    output_tokens: int | None = None  # usage.completion_tokens, else re-tokenized reply
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens
    error: str | None = None  # an ErrorKind name
    error_detail: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def tpot_s(self) -> float | None:
        """(e2e - ttft) / (output - 1); None for one-token outputs and failures."""
        if not self.ok or not self.output_tokens or self.output_tokens <= 1:
            return None
        assert self.e2e_s is not None and self.ttft_s is not None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    @property
    def input_tokens(self) -> int:
        return self.prompt_tokens if self.prompt_tokens is not None else self.expected_prompt_tokens


@dataclass(frozen=True)
class Distribution:
    """Summary of one latency metric, in milliseconds."""

    count: int
    mean: float
    std: float
    min: float
    p50: float
    p90: float
    p99: float
    max: float

    @staticmethod
    def of_seconds(values: Sequence[float]) -> Distribution | None:
        if not values:
            return None
        ms = np.asarray(values, dtype=np.float64) * 1000.0
        p50, p90, p99 = np.percentile(ms, [50, 90, 99]).tolist()
        return Distribution(len(ms), float(ms.mean()), float(ms.std()), float(ms.min()),
                            p50, p90, p99, float(ms.max()))


@dataclass(frozen=True)
class BenchMetrics:
    duration_s: float
    completed: int
    failed: int
    errors: dict[str, int]  # error kind -> count
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float  # completed requests / s
    output_throughput: float  # output tokens / s
    total_token_throughput: float  # (input + output) tokens / s
    good_requests: int | None  # None when no SLO was given
    goodput: float | None  # good requests / s
    cached_tokens: int | None  # None when the server reported no cached-token counts
    cached_token_ratio: float | None
    ttft_ms: Distribution | None
    tpot_ms: Distribution | None
    itl_ms: Distribution | None
    e2e_ms: Distribution | None


def compute_metrics(records: Sequence[RequestRecord], duration_s: float, slo: SLO) -> BenchMetrics:
    done = [r for r in records if r.ok]
    inputs = sum(r.input_tokens for r in done)
    outputs = sum(r.output_tokens or 0 for r in done)
    per_s = 1.0 / duration_s if duration_s > 0 else 0.0
    good = sum(meets_slo(r, slo) for r in done) if slo.any else None
    cached, ratio = _cached(done)
    return BenchMetrics(
        duration_s=duration_s, completed=len(done), failed=len(records) - len(done),
        errors=dict(Counter(r.error for r in records if r.error is not None)),
        total_input_tokens=inputs, total_output_tokens=outputs,
        request_throughput=len(done) * per_s, output_throughput=outputs * per_s,
        total_token_throughput=(inputs + outputs) * per_s,
        good_requests=good, goodput=None if good is None else good * per_s,
        cached_tokens=cached, cached_token_ratio=ratio,
        ttft_ms=Distribution.of_seconds([r.ttft_s for r in done if r.ttft_s is not None]),
        tpot_ms=Distribution.of_seconds([t for r in done if (t := r.tpot_s) is not None]),
        itl_ms=Distribution.of_seconds([gap for r in done for gap in r.itl_s]),
        e2e_ms=Distribution.of_seconds([r.e2e_s for r in done if r.e2e_s is not None]),
    )


def meets_slo(record: RequestRecord, slo: SLO) -> bool:
    """True if a successful request meets every SLO that is set (one-token outputs: TPOT 0)."""
    if not record.ok:
        return False
    checks = ((slo.ttft_ms, record.ttft_s), (slo.tpot_ms, record.tpot_s or 0.0),
              (slo.e2e_ms, record.e2e_s))
    return all(limit is None or (value is not None and value * 1000.0 <= limit)
               for limit, value in checks)


def _cached(done: Sequence[RequestRecord]) -> tuple[int | None, float | None]:
    reported = [r for r in done if r.cached_tokens is not None and r.prompt_tokens]
    if not reported:
        return None, None
    cached = sum(r.cached_tokens or 0 for r in reported)
    return cached, cached / sum(r.prompt_tokens or 0 for r in reported)


def median_interval(values: Sequence[float], level: float = 0.95, resamples: int = 2000,
                    seed: int = 0) -> tuple[float, float]:
    """A bootstrap confidence interval for the median of `values` (seeded, so a report is
    reproducible): the spread of the medians of `resamples` resamples with replacement.
    Benchmarks on a shared machine report it beside a median of repetitions: paired runs
    of a closed batch of eight spread over 0.8-1.2x on the 2-core machines here, so a
    median of nine is good to about +-0.07 and one of thirty to about +-0.04."""
    if not values:
        raise ValueError("no values")
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(values, k=len(values)))
                     for _ in range(resamples))
    tail = (1 - level) / 2
    return medians[int(tail * resamples)], medians[min(resamples - 1, int((1 - tail) * resamples))]
