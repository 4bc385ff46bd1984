"""Real `kiln serve` subprocesses on free ports with the tiny llama, and helpers to poke them.

`server` is shared by the whole session (no auth, default limits); modules that need other
flags, or that kill and restart things, start their own with `start_server`.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from kiln.cluster.worker import STEP_DELAY_ENV

MODEL = "tiny"  # the shared server's --served-model-name
STEP_DELAY_S = 0.003  # a 900-token request lasts at least 2.7 s
SERVER_FLAGS = ["--dtype", "float32", "--threads", "1", "--heartbeat-interval", "0.2"]


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    port: int
    log_path: Path
    api_key: str | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def openai(self, **kwargs):
        from openai import OpenAI
        return OpenAI(base_url=f"{self.base_url}/v1", api_key=self.api_key or "unused",
                      max_retries=0, timeout=kwargs.pop("timeout", 60), **kwargs)

    def http(self, **kwargs) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, headers=self.headers,
                            timeout=kwargs.pop("timeout", 60), **kwargs)

    def worker_pid(self) -> int | None:
        path = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children")
        pids = [int(p) for p in path.read_text().split()] if path.exists() else []
        return pids[0] if pids else None

    def health(self) -> int:
        try:
            return httpx.get(f"{self.base_url}/health", timeout=5).status_code
        except httpx.HTTPError:
            return 0

    def wait_health(self, status: int = 200, timeout: float = 90) -> float:
        """Seconds until /health answers `status` (fails the test after `timeout`)."""
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            if self.proc.poll() is not None:
                pytest.fail(f"kiln serve exited ({self.proc.returncode}):\n{self.log()}")
            if self.health() == status:
                return time.monotonic() - start
            time.sleep(0.05)
        pytest.fail(f"/health never returned {status} within {timeout} s:\n{self.log()}")

    def metrics(self) -> dict[str, float]:
        """Samples of /metrics as {'name{labels}': value}."""
        text = self.http().get("/metrics").text
        found = {}
        for line in text.splitlines():
            m = re.match(r"^(kiln:\S+)\s+(\S+)$", line)
            if m:
                found[m.group(1)] = float(m.group(2))
        return found

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_pair() -> int:
    """A port p with p + 1 free as well (a cluster address: its KV events bind p + 1)."""
    for _ in range(100):
        port = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no two adjacent free ports")


def start_server(model: str, log_dir: Path, *flags: str, api_key: str | None = None,
                 step_delay_s: float = STEP_DELAY_S, wait: bool = True) -> ServerProcess:
    """`kiln serve` on a free port; each engine step takes `step_delay_s` longer (so long
    requests stay long enough to cancel, kill or drain, however fast the model is)."""
    port = free_port()
    log_path = log_dir / f"serve-{port}.log"
    cmd = [sys.executable, "-m", "kiln.cli", "serve", "--model", model, "--port", str(port),
           *SERVER_FLAGS, *flags]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", STEP_DELAY_ENV: str(step_delay_s)}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    server = ServerProcess(proc, port, log_path, api_key)
    if wait:
        server.wait_health(200)
    return server


@pytest.fixture(scope="session")
def server(llama_path, tmp_path_factory):
    """The shared tiny-model server: no auth, max_model_len 1024 (the tiny model's own)."""
    srv = start_server(llama_path, tmp_path_factory.mktemp("serve"), "--served-model-name",
                       MODEL)
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def client(server):
    return server.openai()
