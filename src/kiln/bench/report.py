"""Terminal output of `kiln bench`: the progress bar and the rich summary tables."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from kiln.bench.metrics import BenchMetrics, Distribution

if TYPE_CHECKING:
    from kiln.bench.result import BenchResult


@contextmanager
def progress_bar(show: bool, total: int, description: str) -> Iterator[Callable[[], None]]:
    """Yields `advance()`, to call once per finished request; a no-op when `show` is False."""
    if not show:
        yield lambda: None
        return
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn(), TimeRemainingColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(description, total=total)
        yield lambda: bar.advance(task)


def print_summary(result: BenchResult, console: Console | None = None) -> None:
    console = console or Console()
    console.print(overview_table(result))
    console.print(latency_table(result.metrics))


def overview_table(result: BenchResult) -> Table:
    m, cfg = result.metrics, result.config
    table = Table(title=f"kiln bench serve: {cfg.workload.kind.value}, {cfg.load.describe()}, "
                        f"{cfg.server.endpoint.value} @ {cfg.server.base_url}", show_header=False)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for name, value in _overview_rows(m):
        table.add_row(name, value)
    return table


def _overview_rows(m: BenchMetrics) -> list[tuple[str, str]]:
    rows = [
        ("successful requests", str(m.completed)),
        ("failed requests", str(m.failed)),
        ("duration (s)", f"{m.duration_s:.2f}"),
        ("input tokens", str(m.total_input_tokens)),
        ("output tokens", str(m.total_output_tokens)),
        ("request throughput (req/s)", f"{m.request_throughput:.2f}"),
        ("output throughput (tok/s)", f"{m.output_throughput:.1f}"),
        ("total token throughput (tok/s)", f"{m.total_token_throughput:.1f}"),
    ]
    if m.goodput is not None:
        rows.append(("goodput (req/s)", f"{m.goodput:.2f} ({m.good_requests} good)"))
    if m.cached_token_ratio is not None:
        rows.append(("cached-token ratio", f"{m.cached_token_ratio:.1%}"))
    rows.extend((f"errors: {kind}", str(count)) for kind, count in sorted(m.errors.items()))
    return rows


def latency_table(m: BenchMetrics) -> Table:
    table = Table(title="latency (ms)")
    for col in ("metric", "mean", "p50", "p90", "p99", "max"):
        table.add_column(col, justify="left" if col == "metric" else "right")
    for name, dist in (("TTFT", m.ttft_ms), ("TPOT", m.tpot_ms), ("ITL", m.itl_ms),
                       ("E2E", m.e2e_ms)):
        table.add_row(name, *_dist_cells(dist))
    return table


def _dist_cells(dist: Distribution | None) -> list[str]:
    if dist is None:
        return ["-"] * 5
    return [f"{v:.1f}" for v in (dist.mean, dist.p50, dist.p90, dist.p99, dist.max)]
