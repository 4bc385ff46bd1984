"""Structured output over HTTP with the official `openai` SDK: response_format, the
structured_outputs extension (json, regex, choice, grammar), streamed and not, n > 1; bad
grammars are 400s that name the field, fast, and leave the worker as it was. The repetition
guard's finish_reason, per-request settings and metrics, on a looping model."""

from __future__ import annotations

import json
import re
import time

import jsonschema
import pytest

from tests.engine.test_structured_guard import make_looping_checkpoint
from tests.serve.conftest import MODEL, start_server

MSG = [{"role": "user", "content": "Describe a user."}]
SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "items": {"enum": ["a", "b"]},
                                  "maxItems": 3}},
          "required": ["name", "age"]}
FORMAT = {"type": "json_schema", "json_schema": {"name": "user", "schema": SCHEMA,
                                                 "strict": True}}
# the random model loops inside strings; the guard would end such outputs early (tested below)
NO_GUARD = {"repetition_guard": "off"}


def test_response_format_json_schema(client):
    out = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=300,
                                         temperature=0, response_format=FORMAT,
                                         extra_body=NO_GUARD)
    choice = out.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_streamed_and_n_choices_all_validate(client):
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=MSG, max_tokens=300, temperature=1.0, seed=4, n=3,
        stream=True, response_format=FORMAT, extra_body=NO_GUARD))
    texts = ["", "", ""]
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] += choice.delta.content or ""
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object_and_the_extension_kinds(client):
    out = client.chat.completions.create(
        model=MODEL, messages=MSG, max_tokens=300, temperature=1.0, seed=0,
        response_format={"type": "json_object"}, extra_body={"repetition_guard": "off"})
    assert out.choices[0].message.content.startswith("{")
    for body, check in (({"regex": r"\d{3}-[a-z]{2}"}, lambda t: re.fullmatch(r"\d{3}-[a-z]{2}",
                                                                           t)),
                        ({"choice": ["red", "green"]}, lambda t: t in ("red", "green")),
                        ({"grammar": 'root ::= "ok" | "no"'}, lambda t: t in ("ok", "no"))):
        chat = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=20,
                                              temperature=0,
                                              extra_body={"structured_outputs": body})
        text = client.completions.create(model=MODEL, prompt="Answer:", max_tokens=20,
                                         temperature=0, extra_body={"structured_outputs": body})
        assert check(chat.choices[0].message.content) and check(text.choices[0].text)


@pytest.mark.parametrize("body, param, code", [
    ({"structured_outputs": {"regex": "[.*"}}, "structured_outputs", "invalid_grammar"),
    ({"structured_outputs": {"grammar": ""}}, "structured_outputs", "invalid_grammar"),
    ({"structured_outputs": {"grammar": "root ::= nope"}}, "structured_outputs",
     "invalid_grammar"),
    ({"structured_outputs": {"json": {"type": "strin"}}}, "structured_outputs",
     "invalid_grammar"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", None),
    ({"structured_outputs": {"regex": "a" * (2 << 20)}}, "structured_outputs",
     "grammar_too_large"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                 "schema": {"type": 3}}}},
     "response_format", "invalid_grammar"),
    ({"response_format": {"type": "json_schema"}}, "response_format", None),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "structured_outputs", None),
    ({"repetition_guard": "sometimes"}, "repetition_guard", None),
    ({"repetition_guard": {"token_run": 1}}, "repetition_guard", None),
])
def test_bad_grammars_are_400s(server, body, param, code):
    pid = server.worker_pid()
    started = time.monotonic()
    for path, base in (("/v1/chat/completions", {"messages": MSG}),
                       ("/v1/completions", {"prompt": "x"})):
        r = server.http().post(path, json={**base, **body, "max_tokens": 4},
                               headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == param and (code is None or error["code"] == code), error
    assert time.monotonic() - started < 5
    assert server.worker_pid() == pid
    ok = server.http().post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert ok.status_code == 200


def test_grammar_compiles_are_measured(server, client):
    def compiles() -> float:
        return server.metrics()["kiln:grammar_compile_seconds_count"]

    # a grammar no other test sends: the gateway's compile cache misses on it exactly once
    body = {"structured_outputs": {"regex": "measured-[a-z]{3}"}}
    before = compiles()
    client.completions.create(model=MODEL, prompt="x", max_tokens=4, extra_body=body)
    assert compiles() == before + 1
    client.completions.create(model=MODEL, prompt="x", max_tokens=4, extra_body=body)
    assert compiles() == before + 1  # the second request hits the cache


# -- the repetition guard over HTTP -------------------------------------------------------------

@pytest.fixture(scope="module")
def looping_server(tmp_path_factory):
    path, _ = make_looping_checkpoint(tmp_path_factory.mktemp("looping"))
    srv = start_server(str(path), tmp_path_factory.mktemp("serve-looping"),
                       "--served-model-name", MODEL, step_delay_s=0)
    yield srv
    srv.stop()


def test_a_loop_ends_with_stop_reason_repetition(looping_server):
    """Over HTTP finish_reason keeps to OpenAI's values: a guard stop is "stop", with
    stop_reason "repetition" (vLLM's field); the metrics keep kiln's own reason."""
    client = looping_server.openai()
    before = looping_server.metrics()
    out = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=50,
                                         temperature=0)
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].model_extra["stop_reason"] == "repetition"
    assert out.usage.completion_tokens == 4
    chunks = list(client.completions.create(model=MODEL, prompt="Once", max_tokens=50,
                                            temperature=0, stream=True))
    assert [(c.choices[0].finish_reason, c.choices[0].model_extra["stop_reason"])
            for c in chunks if c.choices[0].finish_reason] == [("stop", "repetition")]
    retry = client.completions.create(model=MODEL, prompt="Once", max_tokens=50,
                                      temperature=0, extra_body={"repetition_guard": "retry"})
    assert retry.choices[0].finish_reason == "stop" and retry.usage.completion_tokens == 8
    assert retry.choices[0].model_extra["stop_reason"] == "repetition"
    assert retry.usage.model_extra["guard_redraws"] == 1
    off = client.completions.create(model=MODEL, prompt="Once", max_tokens=20, temperature=0,
                                    extra_body={"repetition_guard": {"mode": "off"}})
    assert off.choices[0].finish_reason == "length"
    after = looping_server.metrics()
    trips = 'kiln:repetition_guard_trips_total{action="%s"}'
    assert after[trips % "stop"] - before.get(trips % "stop", 0) == 3
    assert after[trips % "retry"] - before.get(trips % "retry", 0) == 1
    assert after['kiln:request_success_total{finished_reason="repetition"}'] >= 3
    client.close()  # no idle keep-alive connection to hold up the server's shutdown


def test_a_loop_inside_a_grammar_is_masked_and_the_json_stays_valid(looping_server):
    """Under a grammar the guard bans the looping token for a redraw instead of stopping:
    the JSON ends valid with finish_reason "stop", and every masked redraw is counted (per
    request in usage.guard_redraws, and as action="mask" in /metrics)."""
    client = looping_server.openai()
    schema = {"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"]}
    before = looping_server.metrics()
    out = client.chat.completions.create(
        model=MODEL, messages=MSG, max_tokens=200, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}})
    choice = out.choices[0]
    assert choice.finish_reason == "stop" and choice.model_extra.get("stop_reason") is None
    jsonschema.validate(json.loads(choice.message.content), schema)
    redraws = out.usage.model_extra["guard_redraws"]
    assert redraws >= 1
    trips = 'kiln:repetition_guard_trips_total{action="mask"}'
    assert looping_server.metrics()[trips] - before.get(trips, 0) == redraws
    client.close()
