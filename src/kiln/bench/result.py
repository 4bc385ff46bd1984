"""The result of one run and its JSON file.

The file is the typed `BenchResult` encoded by msgspec: top-level keys `schema`, `config`,
`environment`, `metrics`, `records` (one request per line, so files stay readable and
diffable). `load_result` decodes and validates it back into the same types.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import socket
import sys
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import msgspec

from kiln.bench.config import BenchConfig
from kiln.bench.metrics import BenchMetrics, RequestRecord

SCHEMA = "kiln-bench-serve/1"


@dataclass(frozen=True)
class Environment:
    """Where and when a run happened (the client's machine)."""

    hostname: str
    cpu_count: int | None  # os.cpu_count()
    cpus_usable: int | None  # CPUs this process may run on
    platform: str
    python: str
    kiln_version: str
    date: str  # UTC, ISO 8601
    command: str  # the command line that produced the file

    @staticmethod
    def capture() -> Environment:
        usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
        return Environment(
            hostname=socket.gethostname(), cpu_count=os.cpu_count(), cpus_usable=usable,
            platform=platform.platform(), python=platform.python_version(),
            kiln_version=_kiln_version(),
            date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
            command=shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]]))


def cpu_summary(cpuinfo: str = "/proc/cpuinfo") -> dict[str, object]:
    """The CPU a CPU benchmark ran on: its model and the vector extensions that decide kiln's
    speed (without AVX-512 BF16 or AMX, bf16 matmuls are emulated and a step's cost grows with
    its query tokens almost as if compute-bound, so speculation's extra tokens stop being
    nearly free)."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open(cpuinfo) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    model = value.strip()
                elif key.strip() in ("flags", "Features"):
                    flags = set(value.split())
                    break
    except OSError:
        pass
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "asimd", "bf16")
    return {"model": model, "extensions": [f for f in wanted if f in flags],
            "native_bf16": bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})}


@dataclass(frozen=True)
class BenchResult:
    schema: str
    config: BenchConfig
    environment: Environment
    metrics: BenchMetrics
    records: tuple[RequestRecord, ...]


def result_to_json(value: object, list_key: str | None = "records") -> str:
    """Indented JSON of a result dataclass, with the items of `list_key` one per line (their
    floats rounded to 6 decimals: microseconds for the records' seconds)."""
    data = msgspec.to_builtins(value)
    items = data.pop(list_key) if list_key in data else None
    text = json.dumps(data, indent=2)
    if items is None:
        return text + "\n"
    lines = ",\n".join("    " + json.dumps(_rounded(item)) for item in items)
    return f'{text[:-2]},\n  "{list_key}": [\n{lines}\n  ]\n}}\n'


def _rounded(value: object, digits: int = 6) -> object:
    """Floats rounded to microseconds (per-request lines stay short); other values as they are."""
    if isinstance(value, float):
        return round(value, digits)
    if isinstance(value, list):
        return [_rounded(v, digits) for v in value]
    if isinstance(value, dict):
        return {k: _rounded(v, digits) for k, v in value.items()}
    return value


def save_result(result: BenchResult, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(result_to_json(result))
    return path


def load_result(path: str | Path) -> BenchResult:
    """Read a result file; ValueError if it is not one (or an incompatible schema)."""
    raw = Path(path).read_bytes()
    try:
        result = msgspec.json.decode(raw, type=BenchResult)
    except msgspec.DecodeError as exc:
        raise ValueError(f"{path} is not a kiln bench serve result: {exc}") from None
    if result.schema != SCHEMA:
        raise ValueError(f"{path} has schema {result.schema!r}; this kiln reads {SCHEMA!r}")
    return result


def _kiln_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kiln")
    except PackageNotFoundError:
        return "unknown"
