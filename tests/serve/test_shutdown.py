"""SIGTERM: admission stops at once, in-flight requests finish within --shutdown-timeout (the
rest are aborted with an error event), the worker goes away and the server exits 0."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.serve.conftest import start_server


def _gone(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status")
    return not status.exists() or "zombie" in status.read_text()


def test_sigterm_drains_in_flight_requests(llama_path, tmp_path):
    srv = start_server(llama_path, tmp_path, "--served-model-name", "m",
                       "--shutdown-timeout", "30")
    worker = srv.worker_pid()
    stream = srv.openai().completions.create(
        model="m", prompt="The quick brown fox", max_tokens=400, temperature=0, stream=True,
        extra_body={"ignore_eos": True})
    first = next(iter(stream))
    srv.proc.send_signal(signal.SIGTERM)
    time.sleep(0.2)
    refused = httpx.post(f"{srv.base_url}/v1/completions",
                         json={"prompt": "hi", "max_tokens": 2}, timeout=5)
    assert refused.status_code == 503
    assert refused.json()["error"]["code"] == "server_shutting_down"
    assert srv.health() == 503
    chunks = [first, *stream]
    assert chunks[-1].choices[0].finish_reason == "length"
    assert srv.proc.wait(20) == 0
    assert "draining: 1 open requests" in srv.log()  # it was in flight at the signal
    deadline = time.monotonic() + 10
    while not _gone(worker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _gone(worker)


def test_sigterm_aborts_what_outlives_the_timeout(llama_path, tmp_path):
    srv = start_server(llama_path, tmp_path, "--served-model-name", "m",
                       "--shutdown-timeout", "0.5", "--max-num-seqs", "1")
    client = srv.openai()
    stream = client.completions.create(model="m", prompt="The quick brown fox", max_tokens=1000,
                                       temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    next(iter(stream))
    start = time.monotonic()
    srv.proc.send_signal(signal.SIGTERM)
    with pytest.raises(openai.APIError) as err:
        for _ in stream:
            pass
    assert "shutting down" in err.value.message
    assert srv.proc.wait(15) == 0
    assert time.monotonic() - start < 0.5 + 10
