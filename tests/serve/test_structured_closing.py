"""Issue 51: the JSON closing budget is never silent. A scripted model that loves to continue
a string or a list item (tests/engine/test_structured_limits.py's `",` checkpoint) is steered
to close its JSON within a small max_tokens: the response parses, its usage says how many
tokens were steered (`usage.json_closing_steered`, chat and completions, streamed and not)
and /metrics counts the steered request once. Responses the budget never touched (ended
early, or unconstrained) carry no such field."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.engine.test_structured_limits import CLOSING, make_loving_checkpoint
from tests.serve.conftest import MODEL, start_server

ITEMS = CLOSING["items"]  # a list of {"name", "quantity"} the model would fill forever
SHORT = {"type": "object", "properties": {"b": {"type": "boolean"}}, "required": ["b"]}
CLOSINGS = "kiln:structured_closings_total"
MSG = [{"role": "user", "content": "List the items."}]


def _format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


@pytest.fixture(scope="module")
def loving_server(tmp_path_factory):
    path = make_loving_checkpoint(tmp_path_factory.mktemp("loving-serve"), '",')
    srv = start_server(str(path), tmp_path_factory.mktemp("serve-loving"),
                       "--served-model-name", MODEL, step_delay_s=0)
    yield srv
    srv.stop()


def _closings(server) -> float:
    return server.metrics().get(CLOSINGS, 0.0)


def _steered(usage) -> int | None:
    return usage.model_extra.get("json_closing_steered")


def test_a_steered_response_is_valid_and_counted(loving_server):
    client = loving_server.openai()
    before = _closings(loving_server)
    text = client.completions.create(model=MODEL, prompt="Items:", max_tokens=40,
                                     temperature=0, extra_body={"response_format":
                                                                _format(ITEMS)})
    assert text.choices[0].finish_reason == "stop", text.choices[0].text
    jsonschema.validate(json.loads(text.choices[0].text), ITEMS)
    assert 0 < _steered(text.usage) <= text.usage.completion_tokens <= 40
    assert _closings(loving_server) - before == 1
    chat = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=40,
                                          temperature=0, response_format=_format(ITEMS))
    jsonschema.validate(json.loads(chat.choices[0].message.content), ITEMS)
    assert 0 < _steered(chat.usage) <= chat.usage.completion_tokens
    assert _closings(loving_server) - before == 2
    client.close()


def test_the_final_usage_chunk_of_a_stream_carries_the_count(loving_server):
    client = loving_server.openai()
    before = _closings(loving_server)
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=MSG, max_tokens=40, temperature=0, stream=True,
        stream_options={"include_usage": True}, response_format=_format(ITEMS)))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(content), ITEMS)
    usage = chunks[-1].usage
    assert usage is not None and 0 < _steered(usage) <= usage.completion_tokens
    streamed = list(client.completions.create(
        model=MODEL, prompt="Items:", max_tokens=40, temperature=0, stream=True,
        stream_options={"include_usage": True},
        extra_body={"response_format": _format(ITEMS)}))
    assert 0 < _steered(streamed[-1].usage)
    # a stream's metrics are recorded as it closes: a later request is answered after that
    client.completions.create(model=MODEL, prompt="x", max_tokens=1)
    assert _closings(loving_server) - before == 2
    client.close()


def test_untouched_responses_carry_no_count(loving_server):
    client = loving_server.openai()
    before = _closings(loving_server)
    early = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=200,
                                           temperature=0, response_format=_format(SHORT))
    assert json.loads(early.choices[0].message.content) in ({"b": True}, {"b": False})
    assert early.usage.completion_tokens < 200 and _steered(early.usage) is None
    free = client.completions.create(model=MODEL, prompt="Items:", max_tokens=16,
                                     temperature=0)
    assert free.choices[0].finish_reason == "length" and _steered(free.usage) is None
    assert "json_closing_steered" not in free.usage.model_dump(exclude_none=True)
    assert _closings(loving_server) == before
    client.close()
