"""Shared by the cluster benchmarks: start a `kiln serve` cluster, run `kiln bench` against
it, stop it, and summarize repeated runs by their medians.

Every server gets `--threads 1` per worker (the machine has 2 vCPUs, shared with other work:
figures are indicative, medians of alternating repeats).
"""

from __future__ import annotations

import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

from kiln.bench.config import BenchConfig, Endpoint, LoadConfig, ServerConfig, WorkloadConfig
from kiln.bench.metrics import BenchMetrics
from kiln.bench.runner import RunOptions, run_benchmark
from kiln.bench.tokens import load_tokenizer
from kiln.models.default import default_model_path

MODEL_NAME = "m"
LOG_DIR = Path(tempfile.gettempdir()) / "kiln-cluster-bench"  # servers' logs, one per run


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metrics(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
    found = {}
    for line in text.decode().splitlines():
        m = re.match(r"^(kiln:\S+)\s+(\S+)$", line)
        if m:
            found[m.group(1)] = float(m.group(2))
    return found


@contextmanager
def cluster(flags: list[str], log_name: str, workers: int, env: dict[str, str] | None = None):
    """A running `kiln serve` with `flags`; yields its port once `workers` are ready."""
    port = free_port()
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    log = LOG_DIR / f"{log_name}.log"
    cmd = [sys.executable, "-m", "kiln.cli", "serve", "--port", str(port), "--threads", "1",
           "--served-model-name", MODEL_NAME, *flags]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, **(env or {})})
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"kiln serve exited: see {log}")
            try:
                if metrics(port).get("kiln:workers_ready", 0) >= workers:
                    break
            except OSError:
                pass
            time.sleep(0.5)
        yield port
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def bench(port: int, workload: WorkloadConfig, load: LoadConfig,
          endpoint: Endpoint = Endpoint.CHAT) -> BenchMetrics:
    tokenizer_dir = str(default_model_path())
    config = BenchConfig(server=ServerConfig(f"http://127.0.0.1:{port}", MODEL_NAME, endpoint),
                         load=load, workload=workload, tokenizer=tokenizer_dir)
    options = RunOptions(tokenizer=load_tokenizer(tokenizer_dir), show_progress=False)
    return run_benchmark(config, options).metrics


def summary(m: BenchMetrics, extra: dict | None = None) -> dict:
    return {"completed": m.completed, "failed": m.failed,
            "cached_token_ratio": m.cached_token_ratio,
            "ttft_p50_ms": m.ttft_ms.p50, "ttft_p90_ms": m.ttft_ms.p90,
            "tpot_p50_ms": m.tpot_ms.p50 if m.tpot_ms else None,
            "itl_p90_ms": m.itl_ms.p90 if m.itl_ms else None,
            "e2e_p50_ms": m.e2e_ms.p50, "output_tok_s": m.output_throughput,
            "duration_s": m.duration_s, **(extra or {})}


def medians(runs: list[dict]) -> dict:
    keys = [k for k, v in runs[0].items() if isinstance(v, (int, float))]
    return {k: statistics.median(r[k] for r in runs if r[k] is not None) for k in keys
            if any(r[k] is not None for r in runs)}


def save(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
    print(f"wrote {path}")
