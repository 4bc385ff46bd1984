"""Grammar-constrained decoding on the tiny random-weight model: whatever the weights say, every
output matches its grammar. 120 generated JSON schemas run as one batch through one engine."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest

from kiln import LLM, SamplingParams
from kiln.engine.core import EngineRequest
from kiln.sampling_params import RepetitionGuardParams, StructuredOutputsParams

NUM_SCHEMAS = 120
MAX_TOKENS = 700  # far above what any generated schema can take (byte-level tokens: 4 per char)
PROMPTS = ["The quick brown fox", '{"name": "kiln",', "def add(a, b):", "Paris is"]


# -- schemas of varied shape ----------------------------------------------------------------------

def _leaf(rng: random.Random) -> dict:
    kind = rng.choice(["string", "pattern", "enum", "integer", "number", "boolean", "null",
                       "const"])
    if kind == "string":
        schema = {"type": "string", "maxLength": rng.randint(1, 8)}
        if rng.random() < 0.4:
            schema["minLength"] = rng.randint(0, schema["maxLength"])
        return schema
    if kind == "pattern":
        return {"type": "string", "pattern": rng.choice(
            ["^[a-z]{1,5}$", "^[A-Z][0-9]{2}$", "^(yes|no)$", "^[0-9]{3}-[0-9]{2}$",
             "^x+y?$".replace("+", "{1,4}")])}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", 1, 2.5, None, True], rng.randint(1, 4))}
    if kind == "integer":
        low = rng.randint(-1000, 1000)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 5000)}
    if kind == "number":
        low = rng.choice([-10.5, 0, 0.25, 3])
        return {"type": "number", "minimum": low, "maximum": low + rng.choice([1, 100, 1e4])}
    if kind == "const":
        return {"const": rng.choice(["fixed", 42, False])}
    return {"type": kind}


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """Objects with required/optional properties, arrays, anyOf, nested up to depth 3."""
    roll = rng.random()
    if depth >= 3 or (depth > 0 and roll < 0.35):
        return _leaf(rng)
    if depth > 0 and roll < 0.5:
        return {"anyOf": [random_schema(rng, depth + 1), _leaf(rng)]}
    if depth > 0 and roll < 0.7:
        low = rng.randint(0, 2)
        return {"type": "array", "items": random_schema(rng, depth + 1), "minItems": low,
                "maxItems": low + rng.randint(0, 2)}
    names = rng.sample(["id", "name", "tags", "score", "ok", "meta", "kind", "when"],
                       rng.randint(1, 4))
    schema = {"type": "object",
              "properties": {n: random_schema(rng, depth + 1) for n in names},
              "required": [n for n in names if rng.random() < 0.6]}
    if rng.random() < 0.5:
        schema["additionalProperties"] = False
    return schema


@pytest.fixture(scope="module")
def llm(llama_path):
    return LLM(llama_path, dtype="float32", kv_cache_memory=64 << 20, num_threads=1,
               max_num_seqs=128)


def _params(i: int, **structured) -> SamplingParams:
    """Half greedy, half seeded sampling at temperature 1. The repetition guard is off: a
    random model loops inside strings ("rurururu"), and the guard would rightly end those
    outputs mid-JSON; here only the grammar is under test."""
    sampling = {"temperature": 0} if i % 2 == 0 else {"temperature": 1.0, "seed": i}
    return SamplingParams(max_tokens=MAX_TOKENS, structured_outputs=StructuredOutputsParams(
        **structured), repetition_guard=RepetitionGuardParams(mode="off"), **sampling)


def test_every_output_matches_its_json_schema(llm):
    rng = random.Random(7)
    schemas = [random_schema(rng) for _ in range(NUM_SCHEMAS)]
    assert len({json.dumps(s, sort_keys=True) for s in schemas}) == NUM_SCHEMAS
    outs = llm.generate([PROMPTS[i % len(PROMPTS)] for i in range(NUM_SCHEMAS)],
                        [_params(i, json=s) for i, s in enumerate(schemas)], use_tqdm=False)
    for schema, out in zip(schemas, outs, strict=True):
        seq = out.outputs[0]
        assert seq.finish_reason == "stop", (schema, seq.text)
        jsonschema.validate(json.loads(seq.text), schema)


def test_json_object_outputs_are_objects(llm):
    """Any JSON object: unbounded, so a random model may loop inside a string until the
    guard stops it; the ones that finish parse."""
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=200,
                             structured_outputs=StructuredOutputsParams(json_object=True))
              for i in range(12)]
    outs = [o.outputs[0] for o in llm.generate(["Paris is"] * 12, params, use_tqdm=False)]
    finished = [o for o in outs if o.finish_reason == "stop"]
    assert len(finished) >= 4 and all(o.text.startswith("{") for o in outs)
    assert all(isinstance(json.loads(o.text), dict) for o in finished)


def test_regex_choice_and_grammar_outputs_match(llm):
    cases = [({"regex": r"[0-9]{3}-[a-z]{2,4}"}, lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", t)),
             ({"regex": r"(true|false)( and (true|false)){0,3}"},
              lambda t: re.fullmatch(r"(true|false)( and (true|false)){0,3}", t)),
             ({"choice": ["yes", "no", 'a "quoted"\nchoice']},
              lambda t: t in ("yes", "no", 'a "quoted"\nchoice')),
             ({"grammar": 'root ::= "(" num ("+" num){0,3} ")"\nnum ::= [1-9] [0-9]{0,2}'},
              lambda t: re.fullmatch(r"\([1-9][0-9]{0,2}(\+[1-9][0-9]{0,2}){0,3}\)", t))]
    params = [_params(i, **spec) for i in range(4) for spec, _ in cases]
    outs = llm.generate([PROMPTS[i % 4] for i in range(len(params))], params, use_tqdm=False)
    for i, out in enumerate(outs):
        check = cases[i % len(cases)][1]
        assert out.outputs[0].finish_reason == "stop" and check(out.outputs[0].text), out


def test_n_children_and_prefix_cache_hits_each_follow_the_grammar(llm):
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0,
                                                     "maximum": 9},
                                               "b": {"enum": ["x", "y", "z"]}},
              "required": ["a", "b"]}
    prompt = "The quick brown fox jumps over the lazy dog. " * 3
    params = SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=64,
                            structured_outputs=StructuredOutputsParams(json=schema))
    first, second = (llm.generate(prompt, params, use_tqdm=False)[0] for _ in range(2))
    assert second.num_cached_tokens >= 16
    for seq in first.outputs + second.outputs:
        jsonschema.validate(json.loads(seq.text), schema)
    assert len({s.text for s in first.outputs}) > 1  # the children differ


def test_a_bad_grammar_fails_before_anything_is_added(llm):
    from kiln.engine.limits import RequestError
    with pytest.raises(RequestError, match="Unclosed") as err:
        llm.generate(["x", "y"], [SamplingParams(), SamplingParams(
            structured_outputs=StructuredOutputsParams(regex="[.*"))], use_tqdm=False)
    assert err.value.param == "structured_outputs" and err.value.code == "invalid_grammar"
    assert not llm.engine.has_unfinished()


def test_a_grammar_that_fails_in_the_engine_finishes_with_an_error(llm):
    engine = llm.engine
    engine.add_request(EngineRequest(request_id="bad", prompt_token_ids=[5, 6, 7], params=(
        SamplingParams(structured_outputs=StructuredOutputsParams(grammar="root ::= nope")))))
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert [o.finish_reason for o in outs] == ["error"]
    assert "not defined" in outs[0].stop_reason


def test_the_prompt_prefills_while_the_grammar_compiles(llama_path, monkeypatch):
    """A slow compile: the request computes its prompt but samples only once it is ready."""
    import threading

    from kiln.structured import compiler as compiler_module

    llm = LLM(llama_path, dtype="float32", kv_cache_memory=8 << 20, num_threads=1)
    gate = threading.Event()
    native = compiler_module.GrammarCompiler._native_compile

    def slow(self, spec, lazy):
        gate.wait(10)
        return native(self, spec, lazy)

    monkeypatch.setattr(compiler_module.GrammarCompiler, "_native_compile", slow)
    engine = llm.engine
    prompt = list(range(3, 40))
    engine.add_request(EngineRequest(request_id="r", prompt_token_ids=prompt, params=(
        SamplingParams(temperature=0, max_tokens=8,
                       structured_outputs=StructuredOutputsParams(choice=["ok"])))))
    assert engine.step() == [] and engine.step() == []
    request = engine.scheduler.requests["r"]
    assert request.num_computed_tokens == len(prompt) - 1  # all but the sampling position
    gate.set()
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    tokens = [t for o in outs for t in o.new_token_ids]
    assert llm.get_tokenizer().decode(tokens, skip_special_tokens=True) == "ok"
    assert outs[-1].finish_reason == "stop"


def test_speculative_drafts_are_cut_at_the_first_token_the_grammar_rejects(llama_path):
    """n-gram drafts come from the prompt, which the grammar mostly forbids: they are
    filtered before verification, and the output still matches."""
    llm = LLM(llama_path, dtype="float32", kv_cache_memory=8 << 20, num_threads=1,
              speculator="ngram")
    schema = {"type": "object", "properties": {"k": {"type": "string", "maxLength": 6},
                                               "v": {"type": "integer", "minimum": 0,
                                                     "maximum": 99}},
              "required": ["k", "v"]}
    prompt = '{"k": "abc", "v": 12} {"k": "abc", "v": 12} {"k": "abc", "v": 12}'
    outs = llm.generate([prompt] * 3, [SamplingParams(
        temperature=0, max_tokens=64, structured_outputs=StructuredOutputsParams(json=schema))
        for _ in range(3)], use_tqdm=False)
    for out in outs:
        jsonschema.validate(json.loads(out.outputs[0].text), schema)
    stats = llm.engine.speculator.stats
    assert stats.num_draft_tokens > 0  # drafts the grammar allowed were verified


def test_draft_filter_keeps_the_prefix_the_grammar_allows(llm):
    """The spec-decode seam: how many leading drafts a request's grammar accepts; the
    grammar's state is unchanged afterwards."""
    tok = llm.get_tokenizer()
    engine = llm.engine
    engine.add_request(EngineRequest(request_id="d", prompt_token_ids=[5, 6], params=(
        SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(
            regex="abc(def)?")))))
    request = engine.scheduler.requests["d"]
    assert request.grammar.ready() or engine.structured.wait_for_compile(5) or \
        request.grammar.ready()
    a, b, c, d = (tok.convert_tokens_to_ids(x) for x in "abcd")
    f = engine.structured.draft_filter
    assert f(request, [a, b, c]) == 3
    assert f(request, [a, c, b]) == 1
    assert f(request, [b]) == 0
    assert f(request, [a, b, c, d]) == 4 and f(request, [a, b, c, a]) == 3
    assert f(request, [a]) == 1  # nothing was consumed by the checks above
    engine.abort_requests(["d"])
    while engine.has_unfinished():
        engine.step()
