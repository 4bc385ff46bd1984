"""Issue 51: a model that always prefers to continue a number, a string or a list still writes
JSON that parses and validates, because the guard masks (never stops) inside a constrained
request; each masked redraw is counted. Crafted checkpoints (the looping model's recipe) make
one token win after any input: a digit, or the quote-comma of a repeated list item."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kiln import LLM, SamplingParams
from kiln.sampling_params import RepetitionGuardParams, StructuredOutputsParams
from kiln.structured.parsers import parse_tool_calls
from kiln.structured.tools import FORMATS, Tool, call_grammar

SCHEMAS = {
    "number": {"type": "object", "properties": {"n": {"type": "number"}}, "required": ["n"]},
    "integer": {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]},
    "string": {"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"]},
    "numbers": {"type": "object", "properties": {"xs": {"type": "array", "items": {
        "type": "number"}}}, "required": ["xs"]},
    "items": {"type": "object", "properties": {"items": {"type": "array", "items": {
        "type": "object", "properties": {"name": {"type": "string"},
                                         "quantity": {"type": "integer"}},
        "required": ["name", "quantity"]}}}, "required": ["items"]},
}
MEMBERS = {"type": "object", "additionalProperties": {"type": "string"}}


def make_loving_checkpoint(path: Path, text: str) -> Path:
    """A tiny model whose every step prefers the first token of `text` (see
    tests/engine/test_structured_guard.py's looping model)."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    from kiln.testing.tiny import make_tiny_checkpoint

    path = make_tiny_checkpoint(path, "mistral")
    tok = AutoTokenizer.from_pretrained(path)
    token = tok.convert_tokens_to_ids([t for t in tok.tokenize(text) if t != "▁"])[0]
    weights = load_file(path / "model.safetensors")
    for name, w in weights.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            w.zero_()
    weights["model.embed_tokens.weight"].copy_(torch.ones_like(
        weights["model.embed_tokens.weight"]))
    weights["lm_head.weight"][token] = 2.0 * weights["model.norm.weight"]
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module", params=["1", '",'])
def loving_llm(request, tmp_path_factory):
    path = make_loving_checkpoint(tmp_path_factory.mktemp("loving"), request.param)
    return LLM(str(path), dtype="float32", kv_cache_memory=8 << 20, num_threads=1)


def _json(llm, schema, max_tokens=400, **params):
    return llm.generate("Data:", SamplingParams(
        max_tokens=max_tokens, structured_outputs=StructuredOutputsParams(json=schema), **params),
        use_tqdm=False)[0].outputs[0]


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_constrained_output_always_ends_valid(loving_llm, name):
    import jsonschema
    before = loving_llm.engine.structured.num_interventions
    for params in ({"temperature": 0}, {"temperature": 0.8, "seed": 3}):
        out = _json(loving_llm, SCHEMAS[name], **params)
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), SCHEMAS[name])
    assert loving_llm.engine.structured.num_interventions >= before


def test_a_number_keeps_at_most_16_significant_digits(tmp_path_factory):
    llm = LLM(str(make_loving_checkpoint(tmp_path_factory.mktemp("ones"), "1")),
              dtype="float32", kv_cache_memory=8 << 20, num_threads=1)
    out = _json(llm, SCHEMAS["integer"], temperature=0)
    digits = str(json.loads(out.text)["n"])
    assert digits.startswith("1" * 16) and len(digits.lstrip("-")) == 16
    assert llm.engine.structured.num_interventions >= 1
    # a schema whose bound needs 21 digits gets them (xgrammar refuses integer bounds past int64); guard off: no limits at all (length)
    big = {"type": "object", "properties": {"n": {"type": "number", "maximum": 1e21}},
           "required": ["n"]}
    wide = _json(llm, big, temperature=0, max_tokens=21 + 5)
    assert "1" * 17 in wide.text  # past the default 16 (xgrammar keeps the maximum itself)
    off = _json(llm, SCHEMAS["integer"], temperature=0,
                repetition_guard=RepetitionGuardParams(mode="off"))
    assert off.finish_reason == "length"


def test_unconstrained_requests_are_unchanged(tmp_path_factory):
    """No grammar, no JSON limits: the guard stops the loop as it always did."""
    llm = LLM(str(make_loving_checkpoint(tmp_path_factory.mktemp("plain"), "1")),
              dtype="float32", kv_cache_memory=8 << 20, num_threads=1)
    out = llm.generate("Data:", SamplingParams(max_tokens=300, temperature=0),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "repetition" and llm.engine.structured.num_interventions == 0


@pytest.mark.parametrize("loving_llm", ['",'], indirect=True)
def test_a_member_value_written_three_times_ends_the_object(loving_llm):
    """The quote-comma lover writes `{"k":",","k":",",...` on and on (16 members before the
    guard stopped it, the redraws used up); now the third copy of the value closes the
    object."""
    before = loving_llm.engine.structured.num_interventions
    out = _json(loving_llm, MEMBERS, temperature=0)
    members = json.loads(out.text, object_pairs_hook=list)
    assert out.finish_reason == "stop" and len(members) == 3, out.text
    assert len({value for _, value in members}) == 1
    assert loving_llm.engine.structured.num_interventions > before


@pytest.mark.parametrize("loving_llm", ["1", '",'], indirect=True)
@pytest.mark.parametrize("choice", ["required", "count"])
def test_a_tool_calls_arguments_stay_valid_and_bounded(loving_llm, choice):
    """Tool-call grammars (structural tags): the JSON limits follow the arguments inside
    `<tool_call>...</tool_call>`, so the digit lover's number stops at 16 digits and the
    quote-comma lover's list stops at the third copy of one element, and the call parses."""
    import jsonschema
    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "tags": {
        "type": "array", "items": {"type": "string"}}}, "required": ["n", "tags"]}
    fmt = FORMATS["hermes"]
    grammar = call_grammar([Tool("count", None, schema)], fmt, choice, parallel=False)
    out = loving_llm.generate("Data:", SamplingParams(
        max_tokens=400, temperature=0, structured_outputs=StructuredOutputsParams(
            structural_tag=grammar)), use_tqdm=False)[0].outputs[0]
    calls = parse_tool_calls(out.text, fmt).calls
    assert out.finish_reason == "stop" and len(calls) == 1, out.text
    arguments = json.loads(calls[0].arguments)
    jsonschema.validate(arguments, schema)
    tags = arguments["tags"]
    assert len(str(arguments["n"]).lstrip("-")) <= 16
    assert all(len(set(tags[i:i + 4])) > 1 for i in range(len(tags) - 3)), tags  # 3 copies


CLOSING = {
    "strings": {"type": "object", "properties": {"s": {"type": "string"}, "t": {
        "type": "string"}, "n": {"type": "integer"}}, "required": ["s", "t", "n"]},
    "numbers": SCHEMAS["numbers"],
    "items": SCHEMAS["items"],
    "optional": {"type": "object", "properties": {"s": {"type": "string"}, "note": {
        "type": "string"}, "xs": {"type": "array", "items": {"type": "string"}}},
        "required": ["s"]},
}


@pytest.mark.parametrize("name", sorted(CLOSING))
def test_the_closing_budget_ends_the_json_within_max_tokens(loving_llm, name):
    """The failures of the 0.7 benchmark, scripted: a model that would go on writing a
    string, a number or list items until max_tokens cut the JSON (`finish_reason` length,
    unparsable) is steered to close it in budget: every response parses, validates and
    stops (the end-of-sequence token is reserved too), and the closings are counted."""
    import jsonschema
    before = loving_llm.engine.structured.num_closings
    for max_tokens in (24, 40, 64):
        for params in ({"temperature": 0}, {"temperature": 0.8, "seed": 3}):
            out = _json(loving_llm, CLOSING[name], max_tokens=max_tokens, **params)
            assert out.finish_reason == "stop" and len(out.token_ids) <= max_tokens, out.text
            jsonschema.validate(json.loads(out.text), CLOSING[name])
    assert loving_llm.engine.structured.num_closings > before


@pytest.mark.parametrize("loving_llm", ["1"], indirect=True)
def test_the_closing_budget_leaves_roomy_requests_alone(loving_llm):
    """A response that ends well inside max_tokens is the same with any larger budget: the
    steering only starts once the tokens left near the cost of closing."""
    short = _json(loving_llm, SCHEMAS["integer"], max_tokens=200, temperature=0)
    longer = _json(loving_llm, SCHEMAS["integer"], max_tokens=400, temperature=0)
    assert short.finish_reason == "stop" and short.token_ids == longer.token_ids
