"""The streaming client and runner of `kiln bench` against fake servers with known behaviour.

Timing tests use the in-process fake server (real HTTP + SSE over loopback) with known delays;
parsing tests use httpx's MockTransport to feed exact byte streams.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import httpx
import pytest

from kiln.bench.client import RequestSpec, StreamingClient, StreamResult, request_body
from kiln.bench.config import (
    BenchConfig,
    Endpoint,
    LoadConfig,
    ServerConfig,
    WorkloadConfig,
    WorkloadKind,
)
from kiln.bench.fakeserver import FakeServer, FakeServerSpec
from kiln.bench.metrics import ErrorKind
from kiln.bench.runner import BenchError, RunOptions, run_benchmark
from kiln.bench.tokens import count_tokens
from kiln.bench.workloads import Message
from kiln.testing.tiny import make_tokenizer

TTFT, ITL = 0.10, 0.03
SLACK = 0.04  # scheduling noise allowed on a loaded 2-core machine


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


@pytest.fixture(scope="module")
def server(tok):
    spec = FakeServerSpec(ttft_s=TTFT, itl_s=ITL, cached_fraction=0.25)
    with FakeServer(spec, count_tokens=lambda text: count_tokens(tok, text)) as fake:
        yield fake


def bench(base_url: str, endpoint: Endpoint = Endpoint.CHAT, **load) -> BenchConfig:
    load = {"num_requests": 4, "concurrency": 2, **load}
    workload = load.pop("workload", WorkloadConfig(input_len=24, output_len=5))
    return BenchConfig(ServerConfig(base_url, "fake", endpoint=endpoint), LoadConfig(**load),
                       workload)


@pytest.mark.parametrize("endpoint", list(Endpoint))
def test_metrics_match_the_servers_known_delays(server, tok, endpoint):
    result = run_benchmark(bench(server.base_url, endpoint), RunOptions(tokenizer=tok))
    m = result.metrics
    assert (m.completed, m.failed) == (4, 0)
    assert m.ttft_ms and m.itl_ms and m.tpot_ms and m.e2e_ms
    assert TTFT * 1e3 <= m.ttft_ms.p50 <= (TTFT + SLACK) * 1e3
    assert (ITL - 0.005) * 1e3 <= m.itl_ms.p50 <= (ITL + SLACK / 2) * 1e3
    assert (ITL - 0.005) * 1e3 <= m.tpot_ms.p50 <= (ITL + SLACK / 2) * 1e3
    assert m.itl_ms.count == 4 * (5 - 1)
    assert m.total_output_tokens == 20
    assert m.cached_token_ratio == pytest.approx(0.25)
    for r in result.records:  # e2e = ttft + every gap; tpot = mean gap; counts from usage
        assert r.e2e_s == pytest.approx(r.ttft_s + sum(r.itl_s))
        assert r.tpot_s == pytest.approx(sum(r.itl_s) / 4)
        assert (r.prompt_tokens, r.output_tokens) == (24, 5)  # the exact prompt size


def test_request_bodies_follow_the_openai_streaming_contract(server):
    server_cfg = ServerConfig("http://x/v1/", "m", endpoint=Endpoint.COMPLETIONS)
    assert server_cfg.url == "http://x/v1/completions"
    spec = RequestSpec(0, 0, 0, (Message("system", "S "), Message("user", "U")), 7, 2)
    body = request_body(server_cfg, spec)
    assert body["prompt"] == "S U" and body["max_tokens"] == 7 and body["temperature"] == 0
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True
    chat = ServerConfig("http://x", "m", ignore_eos=False)
    body = request_body(chat, spec)
    assert body["messages"][0] == {"role": "system", "content": "S "}
    assert "ignore_eos" not in body
    sampled = ServerConfig("http://x", "m", temperature=1.0)  # as vLLM's client leaves it
    assert request_body(sampled, spec)["temperature"] == 1.0
    with pytest.raises(ValueError, match="--temperature"):
        ServerConfig("http://x", "m", temperature=-1.0)


def test_multi_turn_resends_the_conversation_with_real_replies(tok):
    workload = WorkloadConfig(kind=WorkloadKind.MULTI_TURN, sessions=2, turns=3, system_len=8,
                              first_input_len=12, input_len=6, output_len=3)
    with FakeServer(FakeServerSpec(ttft_s=0.01, itl_s=0.005)) as fake:
        config = bench(fake.base_url, num_requests=6, concurrency=2, workload=workload,
                       warmup_requests=0)
        result = run_benchmark(config, RunOptions(tokenizer=tok))
        bodies = fake.requests
    assert result.metrics.completed == 6 and len(bodies) == 6
    by_session: dict[str, list[list[dict]]] = {}
    for body in bodies:  # sessions are told apart by their first user message
        by_session.setdefault(body["messages"][1]["content"], []).append(body["messages"])
    assert len(by_session) == 2
    for turns in by_session.values():
        assert [len(t) for t in turns] == [2, 4, 6]  # system+user, then +assistant+user each
        for before, after in zip(turns, turns[1:], strict=False):
            assert after[: len(before)] == before  # the prefix only grows
            assert after[len(before)] == {"role": "assistant", "content": "t0 t1 t2 "}
    prompts = {r.turn: r.expected_prompt_tokens for r in result.records if r.session_id == 0}
    assert prompts[0] < prompts[1] < prompts[2]


def test_errors_are_counted_by_type(tok):
    spec = FakeServerSpec(ttft_s=0.01, itl_s=0.005, fail_every=3, sse_error_every=4)
    with FakeServer(spec) as fake:
        config = bench(fake.base_url, num_requests=8, concurrency=1, warmup_requests=0)
        result = run_benchmark(config, RunOptions(tokenizer=tok))
    # requests 3, 6 answer 503; 4, 8 break mid-stream; 12 would be both
    assert result.metrics.errors == {"http_503": 2, ErrorKind.SSE_ERROR: 2}
    assert result.metrics.completed == 4
    failed = [r for r in result.records if not r.ok]
    assert all(r.error_detail for r in failed)


def test_max_duration_cancels_requests_in_flight(tok):
    with FakeServer(FakeServerSpec(ttft_s=0.05, itl_s=0.5)) as fake:
        config = bench(fake.base_url, num_requests=3, concurrency=3, warmup_requests=0,
                       max_duration_s=0.3)
        result = run_benchmark(config, RunOptions(tokenizer=tok))
    assert result.metrics.errors == {ErrorKind.CANCELLED: 3}
    assert result.metrics.duration_s == pytest.approx(0.3, abs=0.15)


def test_rate_mode_spaces_arrivals(server, tok):
    config = bench(server.base_url, num_requests=4, concurrency=None, rate=10.0, seed=1,
                   warmup_requests=0)
    result = run_benchmark(config, RunOptions(tokenizer=tok))
    starts = [r.start_s for r in result.records]
    assert result.metrics.completed == 4 and starts[0] < 0.02
    assert starts == sorted(starts) and starts[-1] > 0.05


def test_unreachable_server_fails_the_warm_up(tok):
    with FakeServer() as fake:
        url = fake.base_url  # the port is closed once the server stops
    with pytest.raises(BenchError, match="warm-up"):
        run_benchmark(bench(url), RunOptions(tokenizer=tok))


# ---- exact stream parsing over MockTransport ------------------------------------------------

def send_raw(body: bytes, status: int = 200, endpoint: Endpoint = Endpoint.CHAT,
             count: Callable[[str], int] = lambda text: len(text.split())) -> StreamResult:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(status, content=body)

    async def go() -> StreamResult:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
            server = ServerConfig("http://fake", "m", endpoint=endpoint)
            client = StreamingClient(http, server, count, clock_zero=0.0)
            return await client.send(RequestSpec(0, 0, 0, (Message("user", "hi"),), 4, 1))

    return asyncio.run(go())


def sse(*payloads: str) -> bytes:
    return "".join(f"data: {p}\n\n" for p in payloads).encode()


CHAT = '{"choices":[{"delta":{"content":"%s"}}]}'


def test_usage_gives_token_counts():
    usage = ('{"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":3,'
             '"prompt_tokens_details":{"cached_tokens":4}}}')
    result = send_raw(sse('{"choices":[{"delta":{"role":"assistant"}}]}', CHAT % "a",
                          CHAT % "b", CHAT % "c", usage, "[DONE]"))
    r = result.record
    assert r.ok and result.text == "abc"
    assert (r.prompt_tokens, r.output_tokens, r.cached_tokens) == (9, 3, 4)
    assert len(r.itl_s) == 2  # the role-only chunk carries no content and is not timed


def test_without_usage_the_reply_is_tokenized():
    r = send_raw(sse(CHAT % "one ", CHAT % "two three", "[DONE]")).record
    assert r.ok and r.output_tokens == 3 and r.prompt_tokens is None
    completions = sse('{"choices":[{"text":"x y"}]}', "[DONE]")
    assert send_raw(completions, endpoint=Endpoint.COMPLETIONS).record.output_tokens == 2


def test_a_reply_of_tokens_without_text_is_not_a_failure():
    # under ignore_eos a model may emit only special tokens: no text, but usage counts them
    body = sse('{"choices":[{"text":""}]}', '{"choices":[{"text":"","finish_reason":"length"}]}',
               '{"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":4}}', "[DONE]")
    r = send_raw(body, endpoint=Endpoint.COMPLETIONS).record
    assert r.ok and r.output_tokens == 4 and r.ttft_s is not None and r.e2e_s >= r.ttft_s
    no_tokens = sse('{"choices":[{"text":"","finish_reason":"length"}]}',
                    '{"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":0}}', "[DONE]")
    assert send_raw(no_tokens, endpoint=Endpoint.COMPLETIONS).record.error == ErrorKind.NO_OUTPUT


@pytest.mark.parametrize("body,status,kind", [
    (b'{"error": "busy"}', 429, "http_429"),
    (sse(CHAT % "a"), 200, ErrorKind.INCOMPLETE),
    (sse("[DONE]"), 200, ErrorKind.NO_OUTPUT),
    (sse(CHAT % "a", "not json", "[DONE]"), 200, ErrorKind.BAD_CHUNK),
    (sse(CHAT % "a", '{"error":{"message":"boom"}}'), 200, ErrorKind.SSE_ERROR),
    (b"event: error\ndata: boom\n\n", 200, ErrorKind.SSE_ERROR),
])
def test_failures_become_error_kinds(body, status, kind):
    r = send_raw(body, status).record
    assert r.error == kind and not r.ok and r.ttft_s is None


def test_timeouts_become_error_kind():
    async def handler(request: httpx.Request) -> httpx.Response:
        await asyncio.sleep(1.0)
        return httpx.Response(200, content=sse(CHAT % "a", "[DONE]"))

    async def go() -> StreamResult:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
            server = ServerConfig("http://fake", "m", request_timeout_s=0.05)
            client = StreamingClient(http, server, len, clock_zero=0.0)
            return await client.send(RequestSpec(0, 0, 0, (Message("user", "hi"),), 4, 1))

    assert asyncio.run(go()).record.error == ErrorKind.TIMEOUT
