"""Tool calling through the official `openai` SDK. On the real server with the random tiny
model, tool_choice required / named always yields calls whose arguments validate against the
tool's schema, streamed or not. In-process, a scripted engine checks that auto-mode calls parse
from hermes and bare-JSON text, streamed as OpenAI streams them, and that tool turns of the
history reach the prompt."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest

from kiln.config import ServeConfig
from kiln.engine.contract import EngineCoreOutput
from tests.serve.conftest import MODEL
from tests.serve.fake_engine import FakeEngineClient

MSG = [{"role": "user", "content": "What's the weather in Paris?"}]
# the random model loops inside strings; the guard would end such calls early (tested elsewhere)
NO_GUARD = {"repetition_guard": "off"}
# small schemas: the tiny tokenizer spends ~900 of the tiny model's 1024 tokens on the prompt
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather",
    "parameters": {"type": "object",
                   "properties": {"city": {"type": "string", "maxLength": 5},
                                  "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}
SEARCH = {"type": "function", "function": {
    "name": "search", "parameters": {
        "type": "object", "properties": {"q": {"type": "string", "maxLength": 4},
                                         "f": {"type": "array", "maxItems": 1, "items": {
                                             "anyOf": [{"type": "integer", "minimum": 0,
                                                        "maximum": 9}, {"type": "boolean"}]}}},
        "required": ["q"]}}}
NOARGS = {"type": "function", "function": {"name": "now"}}
MAX_TOKENS = 120
TOOLS = [WEATHER, SEARCH, NOARGS]
SCHEMAS = {t["function"]["name"]: t["function"].get(
    "parameters", {"type": "object", "additionalProperties": False}) for t in TOOLS}


def _check_calls(calls, names=None):
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert names is None or call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("seed", range(4))
def test_required_always_yields_valid_calls(client, seed):
    out = client.chat.completions.create(
        model=MODEL, messages=MSG, tools=TOOLS, tool_choice="required", max_tokens=MAX_TOKENS,
        temperature=1.0, seed=seed, parallel_tool_calls=False, extra_body=NO_GUARD)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    _check_calls(choice.message.tool_calls)


@pytest.mark.parametrize("name", ["get_weather", "search", "now"])
def test_a_named_tool_is_called_with_valid_arguments(client, name):
    out = client.chat.completions.create(
        model=MODEL, messages=MSG, tools=TOOLS, max_tokens=MAX_TOKENS, temperature=0,
        tool_choice={"type": "function", "function": {"name": name}}, extra_body=NO_GUARD)
    _check_calls(out.choices[0].message.tool_calls, {name})


def _streamed_calls(chunks):
    calls, reasons = {}, []
    for chunk in chunks:
        for choice in chunk.choices:
            reasons += [choice.finish_reason] if choice.finish_reason else []
            for d in choice.delta.tool_calls or []:
                key = (choice.index, d.index)
                if d.id is not None:
                    assert key not in calls and d.type == "function" and d.function.name
                    calls[key] = {"id": d.id, "name": d.function.name, "arguments": ""}
                calls[key]["arguments"] += d.function.arguments or ""
    return calls, reasons


def test_streamed_calls_reassemble_to_valid_arguments(client):
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=MSG, tools=TOOLS, tool_choice="required", max_tokens=MAX_TOKENS,
        temperature=1.0, seed=11, n=2, stream=True, parallel_tool_calls=False,
        extra_body=NO_GUARD))
    calls, reasons = _streamed_calls(chunks)
    assert reasons == ["tool_calls", "tool_calls"] and {k[0] for k in calls} == {0, 1}
    for call in calls.values():
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


def test_tool_choice_none_and_auto_leave_text_alone(client):
    """Text stays content: with none, outputs are not parsed; with auto, 8 tokens are too few
    for a whole call (a partial one stays content), and the random model's greedy 8 tokens
    hold neither EOS nor a call."""
    for choice in ("none", "auto"):
        out = client.chat.completions.create(model=MODEL, messages=MSG, tools=TOOLS,
                                             tool_choice=choice, max_tokens=8, temperature=0)
        message = out.choices[0].message
        assert message.tool_calls is None and message.content
        assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 8


@pytest.mark.parametrize("body, param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "strin"}}}}}],
      "tool_choice": "required"}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice"),
])
def test_bad_tool_requests_are_400s(server, body, param):
    r = server.http().post("/v1/chat/completions", json={"messages": MSG, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


# -- in process: scripted model outputs ------------------------------------------------------------

class ScriptedEngine(FakeEngineClient):
    """Emits `script` (token ids) one token per output, then EOS; records the prompts."""

    def __init__(self, vocab_size: int):
        super().__init__(vocab_size, max_model_len=1024)
        self.script: list[int] = []
        self.prompts: list[list[int]] = []

    def _generate(self, r) -> None:
        self.prompts.append(list(r.prompt_token_ids))
        self._emit(r, 0)

    def _emit(self, r, i: int) -> None:
        stream = self._open.get(r.request_id)
        if stream is None:
            return
        last = i == len(self.script) - 1
        stream.deliver(EngineCoreOutput(r.request_id, [self.script[i]],
                                        finish_reason="stop" if last else None))
        if last:
            self._open.pop(r.request_id, None)
        else:
            asyncio.get_running_loop().call_later(0.002, self._emit, r, i + 1)


@pytest.fixture(scope="module")
def scripted(llama_path):
    from fastapi.testclient import TestClient
    from openai import OpenAI

    from kiln.serve.app import build_app
    from kiln.serve.context import ServeContext
    from kiln.serve.frontend import Frontend
    from kiln.serve.metrics import ServeMetrics
    from kiln.serve.usage import DEFAULT_PRICING

    frontend = Frontend.load(llama_path)
    engine = ScriptedEngine(frontend.vocab_size)
    apps = {}
    for parser in ("auto", "json"):
        ctx = ServeContext(config=ServeConfig(tool_call_parser=parser), model_name="fake",
                           frontend=frontend, client=engine, metrics=ServeMetrics(engine),
                           pricing=DEFAULT_PRICING)
        apps[parser] = OpenAI(base_url="http://test/v1", api_key="x", max_retries=0,
                              http_client=TestClient(build_app(ctx)))

    def run(text: str, parser: str = "auto", **kwargs):
        engine.script = frontend.encode(text, add_special_tokens=False) + [2]
        return apps[parser].chat.completions.create(model="fake", **kwargs)

    run.engine, run.frontend = engine, frontend
    return run


HERMES_OUTPUT = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": '
                 '{"city": "Paris", "days": 2}}\n</tool_call>\n<tool_call>\n{"name": "now", '
                 '"arguments": {}}\n</tool_call>')


def test_auto_calls_parse_whole_and_streamed(scripted):
    out = scripted(HERMES_OUTPUT, messages=MSG, tools=TOOLS)
    message = out.choices[0].message
    assert out.choices[0].finish_reason == "tool_calls" and message.content == "Let me look."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("get_weather", {"city": "Paris", "days": 2}), ("now", {})]
    chunks = list(scripted(HERMES_OUTPUT, messages=MSG, tools=TOOLS, stream=True))
    calls, reasons = _streamed_calls(chunks)
    assert reasons == ["tool_calls"]
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in message.tool_calls]
    content = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert content == "Let me look."
    assert len([ch for ch in chunks if ch.choices and ch.choices[0].delta.tool_calls]) > 3


def test_bare_json_calls_with_the_json_parser(scripted):
    text = '{"name": "search", "parameters": {"q": "kiln"}}'
    out = scripted(text, "json", messages=MSG, tools=TOOLS)
    call = out.choices[0].message.tool_calls[0]
    assert (call.function.name, call.function.arguments) == ("search", '{"q": "kiln"}')
    calls, _ = _streamed_calls(scripted(text, "json", messages=MSG, tools=TOOLS, stream=True))
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [("search", '{"q": "kiln"}')]


def test_without_tools_nothing_is_parsed(scripted):
    out = scripted(HERMES_OUTPUT, messages=MSG)
    assert out.choices[0].message.tool_calls is None
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].message.content.startswith("Let me look.\n<tool_call>")


def test_tool_turns_of_the_history_reach_the_prompt(scripted):
    history = MSG + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 21}'}]
    scripted("It is 21 C.", messages=history, tools=TOOLS)
    prompt = scripted.frontend.decode(scripted.engine.prompts[-1])
    assert "# Tools" in prompt and '"name": "search"' in prompt  # the template ignores tools
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 1}}' \
        in prompt
    assert '<tool_response>\n{"temp_c": 21}\n</tool_response>' in prompt
