"""A server with API keys, a price file and a one-sequence admission capacity: 401s on every
route but /health, cost from the price table, 429 when the admission queue is full."""

from __future__ import annotations

import threading

import httpx
import openai
import pytest

from tests.serve.conftest import start_server

KEYS = ("key-one", "key-two")
PRICES = """
["priced"]
input = 2.0
cached_input = 1.0
output = 8.0
"""


@pytest.fixture(scope="module")
def srv(llama_path, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("auth")
    (tmp / "prices.toml").write_text(PRICES)
    s = start_server(llama_path, tmp, "--served-model-name", "priced",
                     "--api-key", KEYS[0], "--api-key", KEYS[1],
                     "--pricing", str(tmp / "prices.toml"),
                     "--max-num-seqs", "1", "--admission-queue-size", "0", api_key=KEYS[1])
    yield s
    s.stop()


@pytest.mark.parametrize("method, path", [
    ("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
    ("GET", "/metrics"), ("POST", "/tokenize"), ("POST", "/detokenize"),
    ("GET", "/openapi.json"), ("GET", "/docs"), ("GET", "/no/such/route"),
])
def test_every_route_but_health_needs_a_key(srv, method, path):
    url = srv.base_url + path
    missing = httpx.request(method, url, json={})
    assert missing.status_code == 401
    assert missing.json()["error"]["code"] is None
    wrong = httpx.request(method, url, json={}, headers={"Authorization": "Bearer key-twO"})
    assert wrong.status_code == 401
    assert wrong.json()["error"]["code"] == "invalid_api_key"
    assert "key-two" not in wrong.text


def test_health_is_open_and_both_keys_work(srv):
    assert httpx.get(f"{srv.base_url}/health").status_code == 200
    for key in KEYS:
        r = httpx.get(f"{srv.base_url}/v1/models", headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 200


def test_auth_comes_before_the_body_limit(srv):
    big = b"x" * (9 << 20)
    r = httpx.post(f"{srv.base_url}/v1/completions", content=big,
                   headers={"content-type": "application/json"})
    assert r.status_code == 401


def test_sdk_auth_error_class(srv):
    bad = srv.openai()
    bad.api_key = "nope"
    with pytest.raises(openai.AuthenticationError) as err:
        bad.models.list()
    assert err.value.body["code"] == "invalid_api_key"


def test_cost_comes_from_the_price_file(srv):
    out = srv.openai().completions.create(model="priced", prompt="Paris is", max_tokens=4,
                                          extra_body={"ignore_eos": True})
    u = out.usage
    cached = u.prompt_tokens_details.cached_tokens
    expected = ((u.prompt_tokens - cached) * 2.0 + cached * 1.0 + 4 * 8.0) / 1e6
    assert u.model_extra["cost"] == pytest.approx(expected)


def test_full_admission_queue_is_429(srv):
    client = srv.openai()
    stream = client.completions.create(model="priced", prompt="The quick brown fox",
                                       max_tokens=900, stream=True, temperature=0,
                                       extra_body={"ignore_eos": True})
    next(iter(stream))
    with pytest.raises(openai.RateLimitError) as err:
        client.completions.create(model="priced", prompt="hi", max_tokens=2)
    assert err.value.body["code"] == "admission_queue_full"
    assert err.value.response.headers.get("retry-after") == "1"
    stream.close()


def test_a_request_bigger_than_the_whole_capacity_is_400(srv):
    with pytest.raises(openai.BadRequestError) as err:
        srv.openai().completions.create(model="priced", prompt="hi", n=2, max_tokens=2)
    assert err.value.body["param"] == "n"


def test_requests_after_the_burst_are_admitted(srv):
    """Once the stream above is gone, capacity is back (no leaked admission slots)."""
    client = srv.openai()
    done = []
    threads = [threading.Thread(target=lambda: done.append(client.completions.create(
        model="priced", prompt="hi", max_tokens=2))) for _ in range(1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(done) == 1
