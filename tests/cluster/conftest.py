"""Real `kiln serve` clusters on the tiny llama: spawned workers, fault injection by env.

`agg` (two aggregated workers, kv-aware) is shared by the session; modules that kill workers
or inject faults start their own with `start_cluster`.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kiln.cluster.worker import STEP_DELAY_ENV
from tests.serve.conftest import SERVER_FLAGS, ServerProcess, free_port

FLAGS = [*SERVER_FLAGS, "--served-model-name", "m"]
TENANT_A, TENANT_B = "key-tenant-a", "key-tenant-b"


def start_cluster(model: str, log_dir: Path, *flags: str, env: dict[str, str] | None = None,
                  step_delay_s: float = 0.003, wait_workers: int = 2,
                  api_key: str | None = None) -> ServerProcess:
    """`kiln serve` with `flags`; returns once `wait_workers` workers are ready."""
    port = free_port()
    log_path = log_dir / f"cluster-{port}.log"
    cmd = [sys.executable, "-m", "kiln.cli", "serve", "--model", model, "--port", str(port),
           *FLAGS, *flags]
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", STEP_DELAY_ENV: str(step_delay_s),
                **(env or {})}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env)
    server = ServerProcess(proc, port, log_path, api_key)
    server.wait_health(200)
    wait_for(lambda: server.metrics().get("kiln:workers_ready", 0) >= wait_workers, 60,
             server)
    return server


def wait_for(condition, timeout: float, server: ServerProcess | None = None,
             what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.05)
    log = server.log() if server is not None else ""
    pytest.fail(f"{what} not met within {timeout} s\n{log}")


def worker_metric(server: ServerProcess, name: str) -> dict[str, float]:
    """{worker id: value} of a per-worker metric, e.g. 'worker_kv_cache_blocks_used'."""
    found = {}
    for key, value in server.metrics().items():
        m = re.match(rf'^kiln:{name}\{{worker="([^"]+)"\}}$', key)
        if m:
            found[m.group(1)] = value
    return found


def worker_pids(server: ServerProcess) -> dict[str, int]:
    """Current pid of each spawned worker, from the gateway's log."""
    pids = {}
    for m in re.finditer(r"worker (\S+)\.\d+ started \(pid (\d+)", server.log_path.read_text()):
        pids[m.group(1)] = int(m.group(2))
    return pids


def tokens(seed: int, n: int) -> list[int]:
    """A prompt of `n` token ids, distinct per seed (the tiny vocabulary has 485 ids)."""
    return [5 + (seed * 131 + i * 7) % 470 for i in range(n)]


@pytest.fixture(scope="session")
def agg(llama_path, tmp_path_factory):
    """Two aggregated workers behind a kv-aware router; every worker drops its KV event
    batch 2 (so the index must notice the gap and resync). Two tenants: requests go out with
    TENANT_A's key unless a test says otherwise."""
    srv = start_cluster(llama_path, tmp_path_factory.mktemp("agg"), "--workers", "2",
                        "--api-key", TENANT_A, "--api-key", TENANT_B, api_key=TENANT_A,
                        env={"KILN_FAULT_DROP_KV_EVENTS": "2"})
    yield srv
    srv.stop()
