"""Grammar compilation: reasons for bad grammars, the size and time limits, the bounded cache,
and the per-request constraint that fills bitmask rows (drafts, bans)."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch

from kiln.config import StructuredConfig
from kiln.runner.sampler import SamplingRow
from kiln.sampling_params import SamplingParams, StructuredOutputsParams
from kiln.structured.bitmask import GrammarRows
from kiln.structured.compiler import GrammarCompiler
from kiln.structured.constraint import TokenConstraint
from kiln.structured.grammar_spec import GrammarError, GrammarSpec, grammar_spec, patch_schema
from kiln.structured.vocab import tokenizer_info


@pytest.fixture(scope="module")
def tokenizer():
    from kiln.testing.tiny import make_tokenizer
    return make_tokenizer()


def compiler_for(tokenizer, **config) -> GrammarCompiler:
    return GrammarCompiler(lambda: tokenizer_info(tokenizer, len(tokenizer)),
                           StructuredConfig(**config))


def spec(**kw) -> GrammarSpec:
    return grammar_spec(StructuredOutputsParams(**kw))


@pytest.mark.parametrize("kw,reason", [
    ({"regex": "[.*"}, "Unclosed '\\['"),
    ({"regex": "(a"}, "parenthesis is not closed"),
    ({"grammar": ""}, "the grammar is empty"),
    ({"grammar": "root ::= foo"}, 'Rule "foo" is not defined'),
    ({"grammar": "root ::= ("}, "EBNF parser error"),
    ({"json": '{"type": "strin"}'}, 'Unsupported type "strin"'),
    ({"json": "{not json"}, "not valid JSON"),
    ({"json": "[1, 2]"}, "must be an object"),
    ({"json": '{"properties": {"a": {"$ref": "#/defs/x"}}}'}, "defs"),
    ({"structural_tag": '{"type": "structural_tag", "format": {"type": "nope"}}'}, "."),
])
def test_invalid_grammars_say_why(tokenizer, kw, reason):
    with pytest.raises(GrammarError, match=reason) as err:
        compiler_for(tokenizer).compile(spec(**kw))
    assert err.value.code == "invalid_grammar"
    assert "/project/cpp" not in str(err.value)  # no native source locations


def test_size_and_depth_limits(tokenizer):
    c = compiler_for(tokenizer, max_source_bytes=1000)
    with pytest.raises(GrammarError, match="at most 1000") as err:
        c.compile(spec(regex="a" * 1001))
    assert err.value.code == "grammar_too_large"
    deep = '{"type": "array", "items": ' * 70 + "{}" + "}" * 70
    with pytest.raises(GrammarError, match="nests 71 levels"):
        compiler_for(tokenizer).compile(spec(json=deep))


def _slow_native(monkeypatch, release: threading.Event, slow_lazy: bool) -> None:
    native = GrammarCompiler._native_compile

    def slow(self, s, lazy):
        if lazy == slow_lazy or not lazy:
            release.wait(5)
        return native(self, s, lazy)

    monkeypatch.setattr(GrammarCompiler, "_native_compile", slow)


def test_a_grammar_check_past_the_limit_is_refused_at_once_afterwards(tokenizer, monkeypatch):
    """The gateway (lazy masks): a grammar still building at the limit is too expensive."""
    c = compiler_for(tokenizer, compile_timeout_s=0.2)
    c.lazy_masks = True
    release = threading.Event()
    _slow_native(monkeypatch, release, slow_lazy=True)
    slow = spec(regex="[a-z]+")
    started = time.monotonic()
    with pytest.raises(GrammarError, match="longer than 0.2 s") as err:
        c.compile(slow)
    assert err.value.code == "grammar_too_expensive" and time.monotonic() - started < 1.0
    started = time.monotonic()
    with pytest.raises(GrammarError, match="longer than"):
        c.compile(slow)
    assert time.monotonic() - started < 0.05  # remembered: no second compile
    release.set()
    time.sleep(0.1)
    assert slow not in c._cache  # the late result is dropped


def test_an_engine_falls_back_to_lazy_masks_past_the_limit(tokenizer, monkeypatch):
    """An engine: the mask precompute runs long, the lazy-mask grammar is used meanwhile,
    and the precomputed one replaces it in the cache when it is done."""
    c = compiler_for(tokenizer, compile_timeout_s=0.2)
    release = threading.Event()
    _slow_native(monkeypatch, release, slow_lazy=False)
    s = spec(regex="[a-z]+")
    lazy = c.compile(s)
    assert c.stats.lazy_fallbacks == 1 and c._cache[s] is lazy
    release.set()
    deadline = time.monotonic() + 5
    while c._cache[s] is lazy:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert c.compile(s) is not lazy and c.stats.hits == 1


def test_the_cache_stays_within_its_size_for_many_distinct_schemas(tokenizer):
    one = compiler_for(tokenizer).compile(spec(json={"type": "object", "properties": {
        "k0": {"type": "integer"}}})).memory_size_bytes
    limit = 20 * one
    c = compiler_for(tokenizer, cache_bytes=limit, compile_threads=2)
    for i in range(1000):
        c.compile(spec(json={"type": "object", "properties": {f"k{i}": {"type": "integer"}}}))
        assert c.cache_bytes <= limit
    assert 10 <= c.cache_len <= 30 and c.stats.misses == 1000
    hit = spec(json={"type": "object", "properties": {"k999": {"type": "integer"}}})
    c.compile(hit)
    assert c.stats.hits == 1 and c.stats.misses == 1000


def test_concurrent_requests_for_one_grammar_share_a_compile(tokenizer):
    c = compiler_for(tokenizer)
    s = spec(json={"type": "object", "properties": {"shared": {"type": "string"}}})
    compilations = [c.submit(s) for _ in range(8)]
    grammars = {id(x.wait()) for x in compilations}
    assert len(grammars) == 1 and c.stats.misses == 1 and c.stats.hits == 7


def test_length_bounded_strings_compile_to_json_safe_patterns():
    schema = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 3},
                                               "b": {"type": "string", "pattern": "^x$"},
                                               "c": {"type": ["string", "null"], "minLength": 2}}}
    patched = patch_schema(schema)
    assert patched["properties"]["a"]["pattern"] == "^[^\\ud800-\\udfff]{0,3}$"
    assert patched["properties"]["b"] == {"type": "string", "pattern": "^x$"}
    assert patched["properties"]["c"]["pattern"] == "^[^\\ud800-\\udfff]{2,}$"
    assert "maxLength" not in patched["properties"]["a"]  # xgrammar would ignore it anyway
    assert "pattern" not in schema["properties"]["a"]  # the input is not modified


def _matcher(tokenizer, **kw):
    constraint = TokenConstraint(compiler_for(tokenizer).submit(spec(**kw)), [2])
    deadline = time.monotonic() + 5
    while not constraint.ready():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    return constraint


def _allowed(bitmask: torch.Tensor, row: int, vocab: int) -> set[int]:
    bits = (bitmask[row][:, None] >> torch.arange(32, dtype=torch.int32)) & 1
    return set(torch.nonzero(bits.reshape(-1)[:vocab]).flatten().tolist())


def test_rows_follow_the_drafts_and_the_state_is_restored(tokenizer):
    ids = {ch: tokenizer.convert_tokens_to_ids(ch) for ch in "abc"}
    constraint = _matcher(tokenizer, regex="ab?c")
    vocab = len(tokenizer)
    bitmask = torch.zeros(3, (vocab + 31) // 32, dtype=torch.int32)
    constraint.fill_rows(bitmask, 0, [ids["a"], ids["b"]])
    assert ids["a"] in _allowed(bitmask, 0, vocab) and ids["b"] not in _allowed(bitmask, 0, vocab)
    assert {ids["b"], ids["c"]} <= _allowed(bitmask, 1, vocab)
    assert ids["c"] in _allowed(bitmask, 2, vocab) and ids["a"] not in _allowed(bitmask, 2, vocab)
    assert constraint.valid_prefix([ids["a"], ids["c"]]) == 2  # back at the start
    assert constraint.accept(ids["a"]) and not constraint.accept(ids["a"])


def test_a_ban_removes_one_token_for_one_draw_unless_it_is_the_only_one(tokenizer):
    vocab = len(tokenizer)
    free = TokenConstraint()
    free.banned = [7]
    bitmask = torch.zeros(1, (vocab + 31) // 32, dtype=torch.int32)
    free.fill_rows(bitmask, 0, [])
    assert _allowed(bitmask, 0, vocab) == set(range(vocab)) - {7}
    forced = _matcher(tokenizer, choice=["x"])
    x = tokenizer.convert_tokens_to_ids("x")
    forced.banned = [x]
    forced.fill_rows(bitmask, 0, [])
    assert _allowed(bitmask, 0, vocab) == {x}  # banning the only choice would allow nothing


def test_batch_rows_point_at_their_bitmask_rows(tokenizer):
    a = _matcher(tokenizer, regex="a+")
    b = _matcher(tokenizer, regex="b+")
    rows = [SamplingRow(SamplingParams(), [], [], None) for _ in range(5)]
    grammar_rows = GrammarRows(len(tokenizer))
    grammar_rows.add(a, 0, [])
    grammar_rows.add(None, 1, [])  # unconstrained
    grammar_rows.add(b, 2, [tokenizer.convert_tokens_to_ids("b")] * 2)
    bitmask = grammar_rows.fill(rows)
    assert [r.bitmask_row for r in rows] == [0, None, 2, 3, 4] and bitmask.shape[0] == 5
    vocab = len(tokenizer)
    a_id = tokenizer.convert_tokens_to_ids("a")
    assert a_id in _allowed(bitmask, 0, vocab) and a_id not in _allowed(bitmask, 2, vocab)
    assert _allowed(bitmask, 1, vocab) == set(range(vocab))  # unconstrained: all ones
    assert GrammarRows(vocab).fill(rows[:1]) is None


def test_the_sampler_kernel_matches_the_torch_reference():
    """xgrammar's CPU kernel (the fast path) and the torch reference mask the same tokens."""
    from kiln.runner.sampler import apply_token_bitmask, apply_token_bitmask_reference
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 1000, generator=gen)
    bitmask = torch.randint(-2**31, 2**31 - 1, (6, 32), generator=gen, dtype=torch.int64).to(
        torch.int32)
    rows = [SamplingRow(SamplingParams(), [], [], None, b) for b in (0, None, 2, 3, None, 5)]
    fast, reference = logits.clone(), logits.clone()
    apply_token_bitmask(fast, rows, bitmask)
    apply_token_bitmask_reference(reference, [(0, 0), (2, 2), (3, 3), (5, 5)], bitmask)
    assert torch.equal(fast, reference) and torch.equal(fast[1], logits[1])
    assert bool(torch.isinf(fast[0]).any())


def test_json_params_keep_their_schema_text():
    schema = {"type": "object", "properties": {"z": {}, "a": {}}}
    params = StructuredOutputsParams(json=schema)
    assert json.loads(params.json) == schema and params.json.index('"z"') < params.json.index('"a"')


def test_a_stop_token_draft_ends_the_rows(tokenizer):
    """EOS among the drafts (n-gram proposals copy it): the rows after it stay unused."""
    ids = {ch: tokenizer.convert_tokens_to_ids(ch) for ch in "ab"}
    constraint = _matcher(tokenizer, regex="ab")
    drafts = [ids["a"], ids["b"], 2, ids["a"]]
    assert constraint.valid_prefix(drafts) == 3
    bitmask = torch.zeros(5, (len(tokenizer) + 31) // 32, dtype=torch.int32)
    constraint.fill_rows(bitmask, 0, drafts)
    assert _allowed(bitmask, 2, len(tokenizer)) == {2}
    assert constraint.valid_prefix([ids["a"]]) == 1  # rolled back to the start


def test_json_without_free_whitespace_is_compact(tokenizer):
    """Issue 51's cause: xgrammar's no-whitespace JSON forces `", "` and `": "`, spaces the
    default model does not write, and its greedy JSON degenerated after them. Kiln's is
    compact; with disable_any_whitespace=False a bounded amount of any whitespace is allowed."""
    import xgrammar as xgr
    schema = {"type": "object", "properties": {"a": {"type": "integer"},
                                               "b": {"type": "string"}}, "required": ["a", "b"]}
    compiler = compiler_for(tokenizer)

    def accepts(text: str, compact: bool) -> bool:
        grammar = compiler.compile(spec(json=schema, disable_any_whitespace=compact))
        return xgr.GrammarMatcher(grammar).accept_string(text)

    assert accepts('{"a":1,"b":"x"}', True)
    assert not accepts('{"a": 1, "b": "x"}', True)
    assert accepts('{"a": 1, "b": "x"}', False) and accepts('{"a":1,"b":"x"}', False)
    assert not accepts('{"a":' + " " * 17 + '1,"b":"x"}', False)


def test_a_ban_of_many_tokens_clears_exactly_their_bits():
    vocab = 200
    row = torch.full((1, (vocab + 31) // 32), -1, dtype=torch.int32)
    constraint = TokenConstraint()
    constraint.banned = [0, 31, 63, 64, 199, 31]  # bit 31: the int32 sign bit
    constraint.apply_ban(row, 0)
    allowed = [t for t in range(vocab) if int(row[0, t // 32]) >> (t % 32) & 1]
    assert allowed == [t for t in range(vocab) if t not in (0, 31, 63, 64, 199)]
    everything = TokenConstraint()
    everything.banned = list(range(7 * 32))
    before = row.clone()
    everything.apply_ban(row, 0)  # would forbid every token: the ban gives way
    assert torch.equal(row, before)


def test_utf8_masks_for_many_rows_at_once_match_one_row_at_a_time():
    """`apply_utf8_rows` (the batched fill) ANDs exactly what `apply_utf8` does per row, and
    leaves a row whole where the AND would allow nothing."""
    import random

    from kiln.structured.bitmask import apply_utf8_rows
    from kiln.structured.utf8 import NUM_STATES, Utf8Table
    rng = random.Random(0)
    vocab = 300
    table = Utf8Table([bytes(rng.randrange(256) for _ in range(rng.randint(1, 3)))
                       for _ in range(vocab - 4)], vocab)
    constraints = []
    for state in [*range(NUM_STATES), 0, 1]:
        c = TokenConstraint()
        c.utf8, c.utf8_state = table, state
        constraints.append(c)
    words = (vocab + 31) // 32
    grammar = torch.randint(-2**31, 2**31 - 1, (len(constraints), words), dtype=torch.int32)
    grammar[-1] = ~table.masks[1]  # nothing left after the AND: the row stays as it was
    one_by_one = grammar.clone()
    for row, c in enumerate(constraints):
        c.apply_utf8(one_by_one, row)
    batched = grammar.clone()
    apply_utf8_rows(batched, [(c, row) for row, c in enumerate(constraints)])
    assert torch.equal(batched, one_by_one) and torch.equal(batched[-1], grammar[-1])
