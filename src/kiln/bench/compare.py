"""`kiln bench compare`: one workload against two servers, in alternating rounds.

Round r runs A then B (B then A on odd rounds, so drift on the machine hits both alike), both
with seed `seed + r`: the two servers get the same prompts within a round, and no round repeats
an earlier round's prompts (which a prefix cache would serve for free). Each metric's median
over rounds is compared as the ratio B / A.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from rich.console import Console
from rich.table import Table

from kiln.bench.config import BenchConfig
from kiln.bench.metrics import BenchMetrics, Distribution
from kiln.bench.result import Environment
from kiln.bench.runner import RunOptions, run_benchmark

SCHEMA = "kiln-bench-compare/1"
SIDES = ("a", "b")


@dataclass(frozen=True)
class CompareConfig:
    a: BenchConfig
    b: BenchConfig  # the same workload, load and SLOs as `a`; only the server differs
    rounds: int = 3

    def __post_init__(self) -> None:
        if self.rounds < 1:
            raise ValueError("--rounds must be >= 1")
        same = (self.a.workload, self.a.load, self.a.slo) == (self.b.workload, self.b.load,
                                                              self.b.slo)
        if not same:
            raise ValueError("compare needs the same workload, load and SLOs on both sides")

    def side(self, name: str) -> BenchConfig:
        return self.a if name == "a" else self.b


@dataclass(frozen=True)
class RoundResult:
    round: int
    side: str  # "a" | "b"
    seed: int
    metrics: BenchMetrics


@dataclass(frozen=True)
class MetricRatio:
    name: str
    unit: str
    higher_is_better: bool
    a: float | None  # median over rounds
    b: float | None
    ratio: float | None  # b / a; None when either is missing or a is 0


@dataclass(frozen=True)
class CompareResult:
    schema: str
    config: CompareConfig
    environment: Environment
    summary: tuple[MetricRatio, ...]
    rounds: tuple[RoundResult, ...]


@dataclass(frozen=True)
class _Metric:
    name: str
    unit: str
    higher_is_better: bool
    get: Callable[[BenchMetrics], float | None]


def _pct(field: str, pct: str) -> Callable[[BenchMetrics], float | None]:
    def get(m: BenchMetrics) -> float | None:
        dist: Distribution | None = getattr(m, field)
        return None if dist is None else getattr(dist, pct)

    return get


COMPARED: tuple[_Metric, ...] = (
    _Metric("request throughput", "req/s", True, lambda m: m.request_throughput),
    _Metric("output throughput", "tok/s", True, lambda m: m.output_throughput),
    _Metric("total token throughput", "tok/s", True, lambda m: m.total_token_throughput),
    _Metric("goodput", "req/s", True, lambda m: m.goodput),
    _Metric("TTFT p50", "ms", False, _pct("ttft_ms", "p50")),
    _Metric("TTFT p99", "ms", False, _pct("ttft_ms", "p99")),
    _Metric("TPOT p50", "ms", False, _pct("tpot_ms", "p50")),
    _Metric("TPOT p99", "ms", False, _pct("tpot_ms", "p99")),
    _Metric("ITL p50", "ms", False, _pct("itl_ms", "p50")),
    _Metric("E2E p50", "ms", False, _pct("e2e_ms", "p50")),
    _Metric("E2E p99", "ms", False, _pct("e2e_ms", "p99")),
    _Metric("cached-token ratio", "", True, lambda m: m.cached_token_ratio),
    _Metric("failed requests", "", False, lambda m: float(m.failed)),  # ratio None when A is 0
)


def run_compare(config: CompareConfig, options: RunOptions | None = None,
                on_round: Callable[[RoundResult], None] | None = None) -> CompareResult:
    """Run every round on both sides and summarize; `on_round` sees each run as it ends."""
    rounds: list[RoundResult] = []
    for r in range(config.rounds):
        seed = config.a.load.seed + r
        for side in SIDES if r % 2 == 0 else SIDES[::-1]:
            bench = config.side(side)
            bench = replace(bench, load=replace(bench.load, seed=seed))
            rounds.append(RoundResult(r, side, seed, run_benchmark(bench, options).metrics))
            if on_round is not None:
                on_round(rounds[-1])
    return CompareResult(SCHEMA, config, Environment.capture(), summarize(rounds), tuple(rounds))


def summarize(rounds: Sequence[RoundResult]) -> tuple[MetricRatio, ...]:
    """Median of each compared metric per side, and the ratio B / A."""
    return tuple(_ratio(metric, rounds) for metric in COMPARED)


def _ratio(metric: _Metric, rounds: Sequence[RoundResult]) -> MetricRatio:
    a, b = (_median([metric.get(r.metrics) for r in rounds if r.side == s]) for s in SIDES)
    ratio = b / a if a and b is not None else None
    return MetricRatio(metric.name, metric.unit, metric.higher_is_better, a, b, ratio)


def _median(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def compare_table(result: CompareResult) -> Table:
    names = (result.config.a.name, result.config.b.name)
    table = Table(title=f"kiln bench compare: median of {result.config.rounds} rounds")
    table.add_column("metric")
    table.add_column(f"A: {names[0]}", justify="right")
    table.add_column(f"B: {names[1]}", justify="right")
    table.add_column("B / A", justify="right")
    table.add_column("better")
    for row in result.summary:
        if row.a is None and row.b is None:
            continue
        table.add_row(f"{row.name} ({row.unit})" if row.unit else row.name, _fmt(row.a),
                      _fmt(row.b), "-" if row.ratio is None else f"{row.ratio:.2f}x",
                      _better(row))
    return table


def print_compare(result: CompareResult, console: Console | None = None) -> None:
    (console or Console()).print(compare_table(result))


def _better(row: MetricRatio, tolerance: float = 0.02) -> str:
    if row.ratio is None:
        return "-"
    if abs(row.ratio - 1.0) <= tolerance:
        return "="
    return "B" if (row.ratio > 1.0) == row.higher_is_better else "A"


def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    if value.is_integer():
        return f"{value:.0f}"
    return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"
