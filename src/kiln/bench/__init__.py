"""kiln bench: a load generator for any OpenAI-compatible server, its metrics, plots and A/B
comparisons.

The programmatic seam is `run_benchmark(BenchConfig, RunOptions) -> BenchResult`; the CLI
(`kiln bench serve | plot | compare`) is a thin layer over it. Names are imported lazily so
that `kiln --help` does not pay for httpx, numpy and rich.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "BenchConfig": "kiln.bench.config",
    "ServerConfig": "kiln.bench.config",
    "LoadConfig": "kiln.bench.config",
    "WorkloadConfig": "kiln.bench.config",
    "WorkloadKind": "kiln.bench.config",
    "Endpoint": "kiln.bench.config",
    "SLO": "kiln.bench.config",
    "BenchMetrics": "kiln.bench.metrics",
    "RequestRecord": "kiln.bench.metrics",
    "BenchResult": "kiln.bench.result",
    "load_result": "kiln.bench.result",
    "save_result": "kiln.bench.result",
    "RunOptions": "kiln.bench.runner",
    "run_benchmark": "kiln.bench.runner",
}

__all__ = [
    "SLO", "BenchConfig", "BenchMetrics", "BenchResult", "Endpoint", "LoadConfig",
    "RequestRecord", "RunOptions", "ServerConfig", "WorkloadConfig", "WorkloadKind",
    "load_result", "run_benchmark", "save_result",
]

if TYPE_CHECKING:
    from kiln.bench.config import (
        SLO,
        BenchConfig,
        Endpoint,
        LoadConfig,
        ServerConfig,
        WorkloadConfig,
        WorkloadKind,
    )
    from kiln.bench.metrics import BenchMetrics, RequestRecord
    from kiln.bench.result import BenchResult, load_result, save_result
    from kiln.bench.runner import RunOptions, run_benchmark


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'kiln.bench' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
