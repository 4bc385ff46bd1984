"""kill -9 a worker under load: every request completes (migrated, token for token as an
undisturbed run) or, with --no-migration, ends with a clear error event; none hangs; the
surviving worker's KV blocks return to baseline."""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import openai
import pytest

from tests.cluster.conftest import start_cluster, tokens, wait_for, worker_metric, worker_pids

N, MAX_TOKENS = 50, 30
PROMPTS = [tokens(100 + i, 24 + (i % 5) * 16) for i in range(N)]


@dataclass
class Result:
    text: str = ""
    chunks: int = 0
    completion_tokens: int | None = None
    finish_reason: str | None = None
    error: str | None = None
    done: threading.Event = field(default_factory=threading.Event)


def stream(server, prompt: list[int], result: Result) -> None:
    try:
        for chunk in server.openai(timeout=60).completions.create(
                model="m", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True}):
            if chunk.choices:
                result.text += chunk.choices[0].text
                result.chunks += 1
                result.finish_reason = chunk.choices[0].finish_reason or result.finish_reason
            if chunk.usage is not None:
                result.completion_tokens = chunk.usage.completion_tokens
    except openai.APIError as exc:
        result.error = str(exc.message)
    finally:
        result.done.set()


def run_and_kill(server, prompts: list[list[int]], victim: str) -> list[Result]:
    """Stream every prompt at once; kill -9 `victim` once ten streams are under way."""
    results = [Result() for _ in prompts]
    threads = [threading.Thread(target=stream, args=(server, p, r))
               for p, r in zip(prompts, results, strict=True)]
    for t in threads:
        t.start()
    wait_for(lambda: sum(r.chunks >= 3 for r in results) >= 10, 30, server, "streams started")
    os.kill(worker_pids(server)[victim], signal.SIGKILL)
    deadline = time.monotonic() + 90
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    hung = sum(not r.done.is_set() for r in results)
    assert hung == 0, f"{hung} requests never ended\n{server.log()}"
    return results


@pytest.fixture(scope="module")
def baseline(agg) -> list[str]:
    def one(prompt: list[int]) -> str:
        r = agg.http().post("/v1/completions", json={
            "model": "m", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]
    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(one, PROMPTS))


def test_kill_9_during_50_requests_migrates_every_stream(llama_path, tmp_path_factory,
                                                        baseline):
    srv = start_cluster(llama_path, tmp_path_factory.mktemp("failover"), "--workers", "2",
                        "--heartbeat-timeout", "3", step_delay_s=0.02)
    try:
        results = run_and_kill(srv, PROMPTS, victim="worker-0")
        errors = [r.error for r in results if r.error]
        assert not errors, errors[:3]
        for r, expected in zip(results, baseline, strict=True):
            assert r.finish_reason == "length" and r.completion_tokens == MAX_TOKENS
            assert r.text == expected  # greedy: identical to the undisturbed run
        m = srv.metrics()
        assert m["kiln:requests_migrated_total"] >= 1
        assert m["kiln:requests_lost_total"] == 0

        def survivor_at_baseline() -> bool:
            used = worker_metric(srv, "worker_kv_cache_blocks_used")
            held = worker_metric(srv, "worker_kv_blocks_held")
            return used.get("worker-1") == 0 and held.get("worker-1") == 0
        wait_for(survivor_at_baseline, 10, srv, "the survivor's KV blocks back to baseline")
        wait_for(lambda: srv.metrics().get("kiln:workers_ready") == 2, 60, srv,
                 "the killed worker restarted")
    finally:
        srv.stop()


def test_without_migration_streams_end_with_an_error_event(llama_path, tmp_path_factory):
    srv = start_cluster(llama_path, tmp_path_factory.mktemp("nomigration"), "--workers", "2",
                        "--no-migration", step_delay_s=0.02)
    try:
        results = run_and_kill(srv, PROMPTS[:16], victim="worker-0")
        failed = [r for r in results if r.error]
        finished = [r for r in results if not r.error]
        assert failed and finished
        assert all("lost" in r.error and "worker-0" in r.error for r in failed)
        assert all(r.completion_tokens == MAX_TOKENS for r in finished)
        assert srv.metrics()["kiln:requests_lost_total"] == len(failed)
        wait_for(lambda: worker_metric(srv, "worker_kv_cache_blocks_used").get("worker-1") == 0,
                 10, srv, "the survivor's KV blocks back to baseline")
    finally:
        srv.stop()
