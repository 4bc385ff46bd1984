"""A client that goes away mid-request: the engine aborts it within 1 s and its KV blocks
return to the pool; other requests carry on."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx

from tests.serve.conftest import MODEL

LONG = {"model": MODEL, "prompt": "The quick brown fox " * 10, "max_tokens": 900,
        "ignore_eos": True, "temperature": 0}


def _idle(server) -> dict[str, float]:
    m = server.metrics()
    return {"running": m["kiln:num_requests_running"], "waiting": m["kiln:num_requests_waiting"],
            "used": m["kiln:kv_cache_blocks_used"], "open": m["kiln:num_requests_open"]}


def _wait_idle(server, timeout: float = 5.0) -> float:
    """Seconds until nothing runs and no KV block is held."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if _idle(server) == {"running": 0, "waiting": 0, "used": 0, "open": 0}:
            return time.monotonic() - start
        time.sleep(0.02)
    raise AssertionError(f"not idle after {timeout} s: {_idle(server)}")


def _aborts(server) -> float:
    return server.metrics().get('kiln:request_success_total{finished_reason="abort"}', 0)


def test_disconnect_mid_stream_aborts_and_frees_kv(server):
    _wait_idle(server)
    aborts = _aborts(server)
    with httpx.Client(base_url=server.base_url, timeout=30) as http:
        with http.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as r:
            lines = r.iter_lines()
            got = [line for line, _ in zip(lines, range(6), strict=False)]
            assert any(line.startswith("data: {") for line in got)
            assert _idle(server)["used"] > 0
    # leaving the block closes the connection mid-stream
    assert _wait_idle(server, timeout=1.0) < 1.0
    assert _aborts(server) == aborts + 1


def test_disconnect_of_a_non_streamed_request(server):
    """Raw socket: send the request, hang up as soon as the engine runs it."""
    _wait_idle(server)
    aborts = _aborts(server)
    body = json.dumps({**LONG, "n": 8}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(head + body)
        deadline = time.monotonic() + 10
        while _idle(server)["running"] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _idle(server)["used"] > 0
    assert _wait_idle(server, timeout=1.0) < 1.0
    assert _aborts(server) == aborts + 8


def test_one_cancel_leaves_a_concurrent_stream_alone(server, client):
    _wait_idle(server)
    result = {}

    def survivor():
        out = client.completions.create(model=MODEL, prompt="Paris is", max_tokens=200,
                                        temperature=0, extra_body={"ignore_eos": True})
        result["finish"] = out.choices[0].finish_reason
        result["tokens"] = out.usage.completion_tokens

    thread = threading.Thread(target=survivor)
    thread.start()
    with httpx.Client(base_url=server.base_url, timeout=30) as http:
        with http.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as r:
            next(r.iter_lines())
    thread.join(60)
    assert result == {"finish": "length", "tokens": 200}
    _wait_idle(server)
