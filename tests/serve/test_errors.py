"""Every error the API promises, with its exact status, `param` and `code`; never a 500."""

from __future__ import annotations

import json

import openai
import pytest

from tests.serve.conftest import MODEL

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MSG = [{"role": "user", "content": "hi"}]


def _error(server, path: str, body, status: int, **headers) -> dict:
    raw = json.dumps(body).encode()  # ASCII escapes, so lone surrogates get through
    response = server.http().post(path, content=raw,
                                  headers={"content-type": "application/json", **headers})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


@pytest.mark.parametrize("path, body, param", [
    (COMPLETIONS, {"prompt": "x", "temperature": 2.5}, "temperature"),
    (COMPLETIONS, {"prompt": "x", "top_p": 0}, "top_p"),
    (COMPLETIONS, {"prompt": "x", "top_k": -2}, "top_k"),
    (COMPLETIONS, {"prompt": "x", "min_p": 1.5}, "min_p"),
    (COMPLETIONS, {"prompt": "x", "presence_penalty": 3}, "presence_penalty"),
    (COMPLETIONS, {"prompt": "x", "frequency_penalty": -3}, "frequency_penalty"),
    (COMPLETIONS, {"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    (COMPLETIONS, {"prompt": "x", "n": 17}, "n"),
    (COMPLETIONS, {"prompt": "x", "n": 0}, "n"),
    (COMPLETIONS, {"prompt": "x", "logprobs": 21}, "logprobs"),
    (COMPLETIONS, {"prompt": "x", "max_tokens": -1}, "max_tokens"),
    (COMPLETIONS, {"prompt": "x", "max_tokens": 2, "min_tokens": 5}, "min_tokens"),
    (COMPLETIONS, {"prompt": "x", "seed": 2**64}, "seed"),
    (COMPLETIONS, {"prompt": "x", "stop": ["a"] * 17}, "stop"),
    (COMPLETIONS, {"prompt": "x", "stop": [""]}, "stop"),
    (COMPLETIONS, {"prompt": "x", "best_of": 3}, "best_of"),
    (COMPLETIONS, {"prompt": "x", "suffix": "y"}, "suffix"),
    (COMPLETIONS, {"prompt": ""}, "prompt"),
    (COMPLETIONS, {"prompt": []}, "prompt"),
    (COMPLETIONS, {"prompt": [[]]}, "prompt"),
    (COMPLETIONS, {"prompt": [1, 10**6]}, "prompt"),
    (COMPLETIONS, {"prompt": [-1]}, "prompt"),
    (COMPLETIONS, {"prompt": "\ud800"}, "prompt"),
    (COMPLETIONS, {"max_tokens": 3}, "prompt"),
    (CHAT, {"messages": []}, "messages"),
    (CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    (CHAT, {"messages": [{"role": "user", "content": "\ud800"}]}, "messages"),
    (CHAT, {"messages": MSG, "max_tokens": 0}, "max_tokens"),
    (CHAT, {"messages": MSG, "top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    (CHAT, {"messages": MSG, "top_logprobs": 2}, "top_logprobs"),
    (CHAT, {"messages": MSG, "temperature": "hot"}, "temperature"),
    (CHAT, {"messages": MSG, "stream": "yes please"}, "stream"),
    (CHAT, {"messages": MSG, "stream": 1}, "stream"),
    (CHAT, {"messages": MSG, "logprobs": "true"}, "logprobs"),
    (CHAT, {"messages": MSG, "structured_outputs": {"json_object": 0}}, "structured_outputs"),
])
def test_bad_parameter_is_a_400_naming_it(server, path, body, param):
    error = _error(server, path, body, 400)
    assert error["param"] == param and error["type"] == "invalid_request_error"


@pytest.mark.parametrize("raw, content_type", [
    (b'{"prompt": "x",', "application/json"),
    (b"[1, 2, 3]", "application/json"),
    (b'"just a string"', "application/json"),
    (b"null", "application/json"),
    (b"\xff\xfe garbage", "application/json"),
    (b"prompt=x", "application/x-www-form-urlencoded"),
])
def test_malformed_bodies_are_400(server, raw, content_type):
    response = server.http().post(COMPLETIONS, content=raw,
                                  headers={"content-type": content_type})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["type"] == "invalid_request_error"


def test_context_length_exceeded_names_both_numbers(server):
    error = _error(server, COMPLETIONS, {"prompt": [5] * 1000, "max_tokens": 100}, 400)
    assert error["code"] == "context_length_exceeded" and error["param"] == "max_tokens"
    assert "1024" in error["message"] and "1100" in error["message"]
    error = _error(server, CHAT, {"messages": [{"role": "user", "content": "fox " * 1100}]}, 400)
    assert error["code"] == "context_length_exceeded" and error["param"] == "messages"


def test_context_length_boundary(server):
    ok = server.http().post(COMPLETIONS, json={"prompt": [5] * 1023, "max_tokens": 1})
    assert ok.status_code == 200, ok.text
    _error(server, COMPLETIONS, {"prompt": [5] * 1024, "max_tokens": 1}, 400)


def test_unknown_model_is_404(server):
    error = _error(server, CHAT, {"model": "gpt-9", "messages": MSG}, 404)
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert server.http().post("/no/such/route", json={}).status_code == 404


def test_body_over_the_limit_is_413(server):
    body = b'{"prompt": "' + b"a" * (8 << 20) + b'"}'
    response = server.http().post(COMPLETIONS, content=body,
                                  headers={"content-type": "application/json"})
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"


def test_sdk_sees_the_openai_error_classes(client):
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=MODEL, messages=MSG, temperature=9)
    assert bad.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="nope", messages=MSG)
    assert missing.value.body["code"] == "model_not_found"


def test_errors_are_counted_and_the_server_is_still_fine(server, client):
    before = server.metrics().get('kiln:http_errors_total{status="400"}', 0)
    _error(server, COMPLETIONS, {"prompt": "x", "n": 99}, 400)
    assert server.metrics()['kiln:http_errors_total{status="400"}'] == before + 1
    out = client.completions.create(model=MODEL, prompt="still alive?", max_tokens=2)
    assert out.choices[0].finish_reason in ("stop", "length")
    assert 'kiln:http_errors_total{status="500"}' not in server.metrics()


def test_no_auth_configured_means_no_key_needed(server):
    assert server.http().get("/v1/models").status_code == 200
    assert server.http().get("/metrics").status_code == 200
