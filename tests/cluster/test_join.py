"""`kiln worker --gateway tcp://...` joins a running gateway, serves, and leaves cleanly; a
worker without the cluster token is turned away."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from tests.cluster.conftest import wait_for, worker_metric
from tests.serve.conftest import free_port_pair, start_server


def join(model: str, gateway: str, worker_id: str, log, token: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "kiln.cli", "worker", "--gateway", gateway, "--model", model,
           "--dtype", "float32", "--threads", "1", "--heartbeat-interval", "0.2",
           "--worker-id", worker_id, "--role", "both", "--transfer-host", "127.0.0.1"]
    env = {**os.environ, "KILN_CLUSTER_TOKEN": token, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)


@pytest.fixture(scope="module")
def gateway(llama_path, tmp_path_factory):
    port = free_port_pair()
    address = f"tcp://127.0.0.1:{port}"
    os.environ["KILN_CLUSTER_TOKEN"] = "s3cret"  # the gateway reads it at start
    try:
        srv = start_server(llama_path, tmp_path_factory.mktemp("join"), "--served-model-name",
                           "m", "--workers", "0", "--cluster-address", address, wait=False)
    finally:
        del os.environ["KILN_CLUSTER_TOKEN"]
    srv.wait_health(503)  # up, but nobody to serve yet
    yield srv, address
    srv.stop()


def test_a_worker_joins_serves_and_leaves(gateway, llama_path, tmp_path):
    srv, address = gateway
    with open(tmp_path / "worker.log", "wb") as log:
        worker = join(llama_path, address, "remote-a", log, token="s3cret")
    try:
        srv.wait_health(200, timeout=60)
        out = srv.openai().completions.create(model="m", prompt="The quick brown fox",
                                              max_tokens=4)
        assert out.usage.completion_tokens == 4
        assert worker_metric(srv, "router_decisions_total") == {"remote-a": 1.0}
        worker.send_signal(signal.SIGTERM)  # Goodbye: removed at once, not after a timeout
        wait_for(lambda: srv.health() == 503, 3, srv, "the worker's departure")
        assert worker.wait(10) == 0
        assert "remote-a left" in srv.log_path.read_text()
    finally:
        if worker.poll() is None:
            worker.kill()


def test_a_worker_without_the_token_is_refused(gateway, llama_path, tmp_path):
    srv, address = gateway
    with open(tmp_path / "intruder.log", "wb") as log:
        worker = join(llama_path, address, "intruder", log, token="wrong")
    try:
        assert worker.wait(60) == 0  # told to go away (Shutdown), it exits
        assert "refused worker intruder: wrong or missing cluster token" in srv.log_path.read_text()
        assert srv.metrics().get("kiln:workers_ready") == 0
    finally:
        if worker.poll() is None:
            worker.kill()

