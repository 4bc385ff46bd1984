"""A worker that dies (kill -9) or hangs (SIGSTOP): in-flight requests fail cleanly, /health
turns 503, the gateway restarts the worker and serves again."""

from __future__ import annotations

import os
import signal
import threading
import time

import openai
import pytest

from tests.serve.conftest import start_server

LONG = {"prompt": "The quick brown fox " * 10, "max_tokens": 900, "temperature": 0,
        "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def srv(llama_path, tmp_path_factory):
    s = start_server(llama_path, tmp_path_factory.mktemp("supervised"),
                     "--served-model-name", "m", "--heartbeat-timeout", "2")
    yield s
    s.stop()


def _in_thread(fn) -> tuple[threading.Thread, dict]:
    result: dict = {}

    def run():
        try:
            result["value"] = fn()
        except Exception as exc:  # recorded for the test to inspect
            result["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    return thread, result


def test_kill_9_fails_requests_then_recovers(srv):
    client = srv.openai(timeout=30)
    old_pid = srv.worker_pid()
    stream = client.completions.create(model="m", stream=True, **LONG)
    first = next(iter(stream))
    assert first.choices[0].text is not None
    blocking, result = _in_thread(lambda: client.completions.create(model="m", **LONG))
    time.sleep(0.3)
    os.kill(old_pid, signal.SIGKILL)
    with pytest.raises(openai.APIError) as err:  # the SSE error event, then [DONE]
        for _ in stream:
            pass
    assert "worker" in str(err.value.message)
    blocking.join(10)
    assert isinstance(result.get("error"), openai.InternalServerError)
    assert result["error"].status_code == 503
    assert result["error"].body["code"] == "worker_lost"
    assert srv.health() == 503 or srv.worker_pid() != old_pid
    srv.wait_health(200, timeout=60)
    assert srv.worker_pid() not in (None, old_pid)
    out = client.completions.create(model="m", prompt="back again", max_tokens=3)
    assert out.usage.completion_tokens == 3
    assert srv.metrics()["kiln:worker_restarts_total"] >= 1


def test_requests_during_the_restart_get_503(srv):
    client = srv.openai(timeout=30)
    srv.wait_health(200, timeout=60)
    os.kill(srv.worker_pid(), signal.SIGKILL)
    srv.wait_health(503, timeout=5)
    with pytest.raises(openai.InternalServerError) as err:
        client.completions.create(model="m", prompt="hello", max_tokens=2)
    assert err.value.status_code == 503
    assert err.value.body["code"] in ("engine_unavailable", "worker_lost")
    srv.wait_health(200, timeout=60)


def test_stuck_worker_is_detected_and_replaced(srv):
    client = srv.openai(timeout=30)
    srv.wait_health(200, timeout=60)
    old_pid = srv.worker_pid()
    blocking, result = _in_thread(lambda: client.completions.create(model="m", **LONG))
    time.sleep(0.3)
    os.kill(old_pid, signal.SIGSTOP)  # alive but silent: only the heartbeat can tell
    try:
        took = srv.wait_health(503, timeout=10)
        assert took < 5  # heartbeat timeout 2 s + one watchdog tick
        blocking.join(10)
        assert result["error"].status_code == 503
        assert "stuck" in result["error"].body["message"]
    finally:
        if srv.worker_pid() == old_pid:
            os.kill(old_pid, signal.SIGCONT)
    srv.wait_health(200, timeout=60)
    assert srv.worker_pid() != old_pid
    assert client.completions.create(model="m", prompt="hi", max_tokens=2).choices
