"""`kiln bench plot`: latency-throughput curves and latency CDFs from result files.

Each result file is one point of a curve: x is its achieved output throughput, y a latency
percentile. Files with the same series name (config label, else model @ server), workload and
load mode (rate or concurrency) form one curve, ordered by offered load. The lower panels are
per-file CDFs.
Drawing uses matplotlib's object API with the Agg canvas, so no display or global backend.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from kiln.bench.metrics import Distribution
from kiln.bench.result import BenchResult


def plot_results(results: Sequence[BenchResult], out: str | Path) -> Path:
    """Write a 2x2 PNG: TTFT and TPOT (p50 solid, p99 dashed) against output throughput,
    then the CDFs of TTFT and E2E latency per file."""
    if not results:
        raise ValueError("no result files to plot")
    fig = Figure(figsize=(13, 9), layout="constrained")
    (ttft, tpot), (ttft_cdf, e2e_cdf) = fig.subplots(2, 2)
    _curves(ttft, results, "ttft_ms", "TTFT (ms)")
    _curves(tpot, results, "tpot_ms", "TPOT (ms)")
    _cdf(ttft_cdf, results, "ttft", "TTFT (ms)")
    _cdf(e2e_cdf, results, "e2e", "E2E latency (ms)")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    return out


def offered_load(result: BenchResult) -> float:
    """Sort key of a point on its curve: concurrency, else rate (all-at-once sorts last)."""
    load = result.config.load
    if load.concurrency is not None:
        return float(load.concurrency)
    return math.inf if load.rate is None else load.rate


def series_name(result: BenchResult) -> str:
    cfg = result.config
    mode = "concurrency" if cfg.load.concurrency is not None else "rate"
    return f"{cfg.name} · {cfg.workload.kind.value} · {mode}"


def series(results: Sequence[BenchResult]) -> dict[str, list[BenchResult]]:
    """Results grouped into curves by series name, each ordered by offered load."""
    groups: dict[str, list[BenchResult]] = defaultdict(list)
    for result in results:
        groups[series_name(result)].append(result)
    return {name: sorted(group, key=offered_load) for name, group in groups.items()}


def _curves(ax: Axes, results: Sequence[BenchResult], field: str, ylabel: str) -> None:
    for name, group in series(results).items():
        xs = [r.metrics.output_throughput for r in group]
        dists: list[Distribution | None] = [getattr(r.metrics, field) for r in group]
        p50 = [np.nan if d is None else d.p50 for d in dists]
        p99 = [np.nan if d is None else d.p99 for d in dists]
        (line,) = ax.plot(xs, p50, "o-", label=f"{name} p50")
        ax.plot(xs, p99, "s--", color=line.get_color(), label=f"{name} p99")
        for x, y, r in zip(xs, p50, group, strict=True):
            ax.annotate(_short_load(r), (x, y), textcoords="offset points", xytext=(4, 4),
                        fontsize=7)
    ax.set_xlabel("output throughput (tok/s)")
    ax.set_ylabel(ylabel)
    ax.set_title(f"{ylabel.split()[0]} vs throughput")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def _cdf(ax: Axes, results: Sequence[BenchResult], metric: str, xlabel: str) -> None:
    for result in results:
        values = sorted(_latencies_ms(result, metric))
        if not values:
            continue
        ys = np.arange(1, len(values) + 1) / len(values)
        ax.step(values, ys, where="post", label=f"{series_name(result)}, {_short_load(result)}")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("fraction of requests")
    ax.set_title(f"{xlabel.split()[0]} CDF")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def _latencies_ms(result: BenchResult, metric: str) -> list[float]:
    values = (r.ttft_s if metric == "ttft" else r.e2e_s for r in result.records if r.ok)
    return [v * 1000.0 for v in values if v is not None]


def _short_load(result: BenchResult) -> str:
    load = result.config.load
    if load.concurrency is not None:
        return f"c={load.concurrency}"
    return "r=inf" if load.rate is None else f"r={load.rate:g}"
