"""Speculative decoding in the engine, on tiny models: lossless with every proposer.

Greedy output is token-identical with speculation on and off, inside continuous batching,
with prefix caching, chunked prefill, preemption, stop tokens and strings, max_tokens and
n > 1; sampled output keeps the target's distribution (chi-square over many seeds).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from kiln import LLM, SamplingParams
from kiln.config_speculative import (
    HEAD_TREE_DRAFTS,
    HEAD_TREE_MIN_PROB,
    HEAD_TREE_WIDTH,
    MAX_TREE_DRAFTS,
    SpeculativeConfig,
)
from kiln.engine.scheduler import tree_depths
from kiln.speculative.proposer import Draft, DraftTrie, register_proposer
from kiln.speculative.routing import LookupRouting, MatchRecord, RequestRecord

# always k = 3 (every path gets exercised), in chains, every proposer alone (a head's default
# is trees with lookup joined: test_a_head_drafts_trees_with_lookup_joined_by_default)
FORCED = SpeculativeConfig(adaptive=False, ngram_first=False, tree_width=1)
# the speculator's weights as stored (not int8): for tests that compare drafts with a dense
# model's own greedy tokens
EXACT = dataclasses.replace(FORCED, speculator_int8=False)


def greedy(max_tokens: int = 24, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def prompts(tok) -> list[dict]:
    system = "The quick brown fox jumps over the lazy dog. " * 3
    texts = [system + "Paris is", "def add(a, b):\n    return a + b\n\ndef add(",
             system + "0123456789", "Large language models", "the and of to in is for"]
    return [{"prompt_token_ids": tok.encode(t)} for t in texts]


def ids(outputs) -> list[list[int]]:
    return [c.token_ids for o in outputs for c in o.outputs]


@pytest.fixture(scope="module")
def draft_path(tiny_ckpt) -> str:
    """An early-exit draft: the tiny llama's embedding and first layer, other final norm."""
    return tiny_ckpt("llama", num_hidden_layers=1)


@pytest.fixture(scope="module")
def head_path(llama_path, tmp_path_factory) -> str:
    """An untrained head: random drafts, so rejection and rollback happen all the time."""
    from kiln.models.loader import read_hf_config
    from kiln.models.registry import resolve_architecture
    from kiln.speculative.head.model import EagleHead, HeadConfig, save_head

    _, arch = resolve_architecture(read_hf_config(llama_path))
    torch.manual_seed(0)
    head = EagleHead(HeadConfig.for_target(arch, 256, (0, -1)))  # layer 0 + final features
    out = tmp_path_factory.mktemp("head")
    save_head(head, out, torch.float32)
    return str(out)


@pytest.fixture(scope="module")
def reference(llama_path):
    llm = LLM(llama_path, dtype="float32", num_threads=1)
    ps = prompts(llm.get_tokenizer())
    params = [greedy(max_tokens=m) for m in (24, 7, 30, 1, 16)]
    return llm, ps, params, ids(llm.generate(ps, params, use_tqdm=False))


def speculator_for(name: str, llama_path, draft_path, head_path) -> str:
    return {"ngram": "ngram", "draft": draft_path, "self": llama_path, "head": head_path}[name]


@pytest.mark.parametrize("proposer", ["ngram", "draft", "self", "head"])
def test_greedy_is_token_identical_with_each_proposer(proposer, reference, llama_path,
                                                      draft_path, head_path):
    _, ps, params, expected = reference
    llm = LLM(llama_path, dtype="float32", num_threads=1, max_num_batched_tokens=48,
              speculator=speculator_for(proposer, llama_path, draft_path, head_path),
              speculative_config=EXACT if proposer == "self" else FORCED)
    first = llm.generate(ps, params, use_tqdm=False)
    again = llm.generate(ps, params, use_tqdm=False)  # prefix-cache hits this time
    assert ids(first) == expected and ids(again) == expected
    assert all(len(c.token_ids) <= p.max_tokens for o, p in zip(first, params, strict=True)
               for c in o.outputs)
    stats = llm.engine.speculator.stats
    assert stats.num_draft_tokens > 0
    if proposer == "self":  # the target drafting for itself: every draft is accepted
        assert stats.num_accepted_tokens == stats.num_draft_tokens
    assert llm.engine.kv.stats().used_blocks == 0 and llm.engine.kv.stats().hit_tokens > 0


@pytest.mark.parametrize("method", ["ngram", "eagle"])
def test_a_vllm_style_speculative_config_dict_drives_the_engine(method, reference, llama_path,
                                                               head_path):
    """`LLM(speculative_config={...})` as vLLM users write it: the named proposer drafts
    the asked k, and greedy output is unchanged."""
    _, ps, params, expected = reference
    spec = {"method": method, "num_speculative_tokens": 2, "adaptive": False,
            "tree_width": 1, "ngram_first": False}
    if method == "eagle":
        spec["model"] = head_path
    llm = LLM(llama_path, dtype="float32", num_threads=1, speculative_config=spec)
    assert ids(llm.generate(ps, params, use_tqdm=False)) == expected
    config, stats = llm.engine.speculator.config, llm.engine.speculator.stats
    assert (config.method, config.num_speculative_tokens) == (
        {"ngram": "ngram", "eagle": "head"}[method], 2)
    assert 0 < stats.num_draft_tokens <= 2 * stats.num_verify_steps


def test_request_metrics_count_drafts_per_position(reference, llama_path):
    """RequestOutput.metrics: totals and per-draft-position counts agree with each other and
    with the engine's totals; a later position is never drafted or accepted more often."""
    _, ps, params, _ = reference
    llm = LLM(llama_path, dtype="float32", num_threads=1, speculator="ngram",
              speculative_config=FORCED)
    metrics = [o.metrics for o in llm.generate(ps, params, use_tqdm=False) if o.metrics]
    assert metrics
    for m in metrics:
        drafted, accepted = m["drafted_per_position"], m["accepted_per_position"]
        assert sum(drafted) == m["num_draft_tokens"] and drafted[0] == m["num_verify_steps"]
        assert sum(accepted) == m["num_accepted_tokens"] and len(drafted) <= 3
        assert all(a <= d for a, d in zip(accepted, drafted, strict=False))
        assert drafted == sorted(drafted, reverse=True)
        assert accepted == sorted(accepted, reverse=True)
    stats = llm.engine.speculator.stats
    assert sum(m["num_accepted_tokens"] for m in metrics) == stats.num_accepted_tokens
    assert sum(m["num_draft_tokens"] for m in metrics) == stats.num_draft_tokens


@pytest.mark.parametrize("proposer", ["draft", "head"])
def test_ngram_first_splits_requests_and_stays_lossless(proposer, reference, llama_path,
                                                        draft_path, head_path):
    """ngram_first: requests whose text repeats take an n-gram match's drafts, the others
    the model's; the proposer still follows every step; output unchanged."""

    _, ps, params, expected = reference
    llm = LLM(llama_path, dtype="float32", num_threads=1, max_num_batched_tokens=48,
              speculator=speculator_for(proposer, llama_path, draft_path, head_path),
              speculative_config=dataclasses.replace(FORCED, ngram_first=True))
    spec = llm.engine.speculator
    calls, inner = [], spec.proposer.propose
    spec.proposer.propose = lambda sched, wanted: calls.append(len(wanted)) or inner(sched,
                                                                                     wanted)
    assert ids(llm.generate(ps, params, use_tqdm=False)) == expected
    to_model = sum(calls)
    asked = spec.stats.num_verify_steps  # request-steps that verified drafts, either source
    assert 0 < to_model < asked  # both sources drafted
    assert 0 in calls  # steps where n-gram matches served everyone: the proposer still ran
    assert llm.engine.kv.stats().used_blocks == 0
    assert {source.name for source in spec.sources} == {"ngram", proposer}


def test_request_metrics_count_drafts_by_source(reference, llama_path, head_path):
    """With ngram_first, RequestOutput.metrics splits drafts by who drafted them: lookup
    ("ngram") and the head, adding up to the request's totals."""

    _, ps, params, _ = reference
    llm = LLM(llama_path, dtype="float32", num_threads=1, speculator=head_path,
              speculative_config=dataclasses.replace(FORCED, ngram_first=True))
    metrics = [o.metrics for o in llm.generate(ps, params, use_tqdm=False) if o.metrics]
    seen = set()
    for m in metrics:
        by_source = m["drafts_by_source"]
        seen |= set(by_source)
        assert sum(d for d, _ in by_source.values()) == m["num_draft_tokens"]
        assert sum(a for _, a in by_source.values()) == m["num_accepted_tokens"]
        assert all(0 <= a <= d for d, a in by_source.values())
    assert seen == {"ngram", "head"}


@pytest.mark.parametrize(("k_model", "k_lookup"), [(1, 3), (3, 2)])
def test_ngram_first_lookup_and_model_each_draft_their_own_k(k_model, k_lookup, reference,
                                                             llama_path, head_path):
    """With ngram_first the lookup's drafts and the head's get a k each (lookup costs
    nothing to propose, the head does), and each controller learns its own acceptance."""

    _, ps, params, expected = reference
    llm = LLM(llama_path, dtype="float32", num_threads=1, speculator=head_path,
              speculative_config=dataclasses.replace(FORCED, ngram_first=True))
    spec = llm.engine.speculator
    spec.adaptive.choose = lambda batch, ids=(), left=None: k_model
    spec.lookup.choose = lambda batch, ids=(), left=None: k_lookup
    asked, to_model, stored = [], set(), {"model": [], "lookup": []}
    inner_propose, inner_filter = spec.proposer.propose, spec.draft_filter

    def propose(sched, wanted):  # this round's model requests; every other draft is lookup's
        asked.extend(w.max_drafts for w in wanted)
        to_model.clear()
        to_model.update(w.request.request_id for w in wanted)
        return inner_propose(sched, wanted)

    def draft_filter(request, drafts):  # sees every chain stored, after the proposer ran
        stored["model" if request.request_id in to_model else "lookup"].append(len(drafts))
        return inner_filter(request, drafts)

    spec.proposer.propose, spec.draft_filter = propose, draft_filter
    assert ids(llm.generate(ps, params, use_tqdm=False)) == expected
    assert asked and max(asked) == k_model
    assert max(stored["lookup"]) == k_lookup and max(stored["model"]) <= k_model
    assert spec.adaptive.verifications > 0 and spec.lookup.verifications > 0
    # the untrained head is rarely right, lookup on these repetitive prompts often
    assert spec.lookup.acceptance(1) > spec.adaptive.acceptance(1)


@pytest.mark.parametrize("model_promises", [1.0, 4.0])
@pytest.mark.parametrize("adaptive", [True, False])
def test_ngram_first_gives_a_match_length_lookup_misses_on_to_the_model(
        adaptive, model_promises, reference, llama_path, head_path):
    """ngram_first keeps lookup's acceptance by match length: a match whose length has paid
    less than the model's drafts promise goes to the model (here a model that promises k = 3
    accepted: every length but the ones lookup got wholly right), one that promises nothing
    leaves every match with lookup. A request whose own lookup steps missed may send a
    length not yet tried to the model too. Adaptive speculation weighs the two sources' step costs
    too (here unknown); without it (k fixed) acceptance alone decides, costs known or not.
    Output unchanged either way."""

    _, ps, params, expected = reference
    llm = LLM(llama_path, dtype="float32", num_threads=1, speculator=head_path,
              speculative_config=dataclasses.replace(FORCED, adaptive=adaptive,
                                                     ngram_first=True))
    spec = llm.engine.speculator
    spec.adaptive.choose = spec.lookup.choose = lambda batch, ids=(), left=None: 3
    spec.adaptive.expected_tokens = lambda k, ids=(): model_promises
    if adaptive:
        spec.adaptive.cost = spec.lookup.cost = lambda batch, k: None  # tokens decide alone
    else:  # costs that favour lookup 10:1 are not weighed
        spec.adaptive.cost, spec.lookup.cost = (lambda batch, k: 1.0), (lambda batch, k: 0.1)
    routing = spec.routing
    routed, inner = [], routing.prefers_lookup

    def prefers_lookup(match, costs):
        own = routing.request_record(match.request_id)  # its own lookup steps so far
        routed.append((match.length, own is not None and own.accepted < own.promised,
                       inner(match, costs)))
        return routed[-1][2]

    routing.prefers_lookup = prefers_lookup
    assert ids(llm.generate(ps, params, use_tqdm=False)) == expected
    records = routing.by_length
    assert records and all(r.verifies > 0 and 0 <= r.accepted <= 3 * r.verifies
                           for r in records.values())
    to_model = [(n, own_missed) for n, own_missed, to_lookup in routed if not to_lookup]
    if model_promises == 1.0:
        assert not to_model  # lookup's worst prior (1 + 0 accepted) still ties the model
    else:  # its length missed, or the request's own lookup steps did
        assert to_model and all(own_missed or (n in records and records[n].accepted
                                               < 3 * records[n].verifies)
                                for n, own_missed in to_model)
    assert not routing.tracked and llm.engine.kv.stats().used_blocks == 0


def test_a_request_whose_lookup_steps_miss_leaves_a_record_learned_elsewhere(
        reference, llama_path, head_path):
    """Lookup's record by match length is learned over all traffic: here it says every
    length's drafts were wholly right over 1000 steps (as code traffic's long matches are),
    which no step here can outweigh. A request's own lookup steps scale that record: each
    request's first match goes to lookup (the record alone), and a request whose lookup
    drafts then miss sends its later matches to the model, with the record still at k
    accepted: alone, it would still send every match to lookup. Output unchanged; finished
    requests leave no record."""
    _, ps, params, expected = reference
    llm = LLM(llama_path, dtype="float32", num_threads=1, speculator=head_path,
              speculative_config=dataclasses.replace(FORCED, ngram_first=True))
    spec = llm.engine.speculator
    spec.adaptive.choose = spec.lookup.choose = lambda batch, ids=(), left=None: 3
    spec.adaptive.expected_tokens = lambda k, ids=(): 2.5
    spec.routing = routing = LookupRouting(spec.routing.params, {
        n: MatchRecord(verifies=1000.0, accepted=3000.0) for n in range(1, 64)})
    routed, inner = [], routing.prefers_lookup

    def prefers_lookup(match, costs):
        own = routing.request_record(match.request_id) or RequestRecord()
        routed.append((match.request_id, (own.steps, own.accepted, own.promised),
                       inner(match, costs)))
        return routed[-1][2]

    routing.prefers_lookup = prefers_lookup
    assert ids(llm.generate(ps, params, use_tqdm=False)) == expected
    first = {}
    for rid, own, to_lookup in routed:
        first.setdefault(rid, (own, to_lookup))
    assert all(own[0] == 0 and to_lookup for own, to_lookup in first.values())
    to_model = [own for _, own, to_lookup in routed if not to_lookup]
    assert to_model and all(steps > 0 and made < promised for steps, made, promised in to_model)
    assert all(routing.expected_tokens(n) > 2.5 for n in routing.by_length)  # alone: lookup
    assert not routing.tracked


def test_a_match_stays_with_lookup_in_a_model_step_only_where_it_promises_as_much(
        reference, llama_path, head_path):
    """In a step where the model drafts anyway (for the requests without a match), the step
    costs what a model step costs: a match then stays with lookup only where its length has
    made at least the tokens the model promises, however much cheaper a lookup-only step is
    (here 10:1, which alone would send every match to lookup). Output unchanged."""
    _, ps, params, expected = reference
    llm = LLM(llama_path, dtype="float32", num_threads=1, speculator=head_path,
              speculative_config=dataclasses.replace(FORCED, adaptive=True, ngram_first=True))
    spec = llm.engine.speculator
    spec.adaptive.choose = spec.lookup.choose = lambda batch, ids=(), left=None: 3
    spec.adaptive.expected_tokens = lambda k, ids=(): 2.5
    spec.adaptive.cost, spec.lookup.cost = (lambda batch, k: 1.0), (lambda batch, k: 0.1)
    routing, kept, passed = spec.routing, [], []
    inner = routing.route

    def route(step, preferred, model_drafts):
        decided = inner(step, preferred, model_drafts)
        if model_drafts:  # the model drafts this step
            for matches, into in ((decided.lookup, kept), (decided.passed_over, passed)):
                into.extend(routing.expected_tokens(m.length, m.request_id) for m in matches)
        return decided

    routing.route = route
    assert ids(llm.generate(ps, params, use_tqdm=False)) == expected
    assert kept and all(tokens >= 2.5 for tokens in kept)
    assert passed and all(tokens < 2.5 for tokens in passed)


def test_speculator_weights_are_int8_unless_asked_otherwise(llama_path, draft_path,
                                                           head_path):
    """speculator_int8 (default): the draft model loads int8 weight-only, a head's linears
    keep int8 copies for decode-sized inputs; False keeps the stored weights."""
    from kiln.speculative.head.model import SmallBatchInt8, int8_gemv_available

    if not int8_gemv_available():
        pytest.skip("kiln's C++ kernels did not build here")  # then nothing is int8
    for config, int8 in ((FORCED, True), (EXACT, False)):
        draft = LLM(llama_path, dtype="float32", num_threads=1, speculator=draft_path,
                    speculative_config=config).engine.speculator.proposer
        qkv = draft.runner.model.model.layers[0].self_attn.qkv_proj
        assert (type(qkv.method).__name__ == "Int8LinearMethod") == int8
        head = LLM(llama_path, dtype="float32", num_threads=1, speculator=head_path,
                   speculative_config=config).engine.speculator.proposer
        assert isinstance(head.lm, SmallBatchInt8) == int8
        assert isinstance(head.head.fc, SmallBatchInt8) == int8


def test_draft_model_with_a_draft_vocabulary(reference, llama_path, tmp_path):
    """A draft checkpoint whose speculator.json lists a draft_vocab proposes only those tokens
    (its LM head restricted to their rows); the target's output is unchanged. Here the draft
    is the target itself: with the whole vocabulary every draft would be accepted."""
    import json
    import shutil

    _, ps, params, expected = reference
    draft = tmp_path / "draft"
    shutil.copytree(llama_path, draft)
    allowed = set(t for seq in expected for t in seq[::2])  # about half the target's choices
    meta = draft / "speculator.json"
    meta.write_text(json.dumps({"kind": "draft", "draft_vocab": sorted(allowed)}))
    llm = LLM(llama_path, dtype="float32", num_threads=1, speculator=str(draft),
              speculative_config=FORCED)
    proposer, drafted = llm.engine.speculator.proposer, []
    inner = proposer.propose
    proposer.propose = lambda sched, wanted: [drafted.extend(d.token_ids) or d
                                              for d in inner(sched, wanted)]
    assert ids(llm.generate(ps, params, use_tqdm=False)) == expected
    assert drafted and set(drafted) <= allowed
    stats = llm.engine.speculator.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    # the target's LM head rows for the draft vocabulary guess its choices in verification
    assert llm.engine.runner.shortlist.ids.tolist() == sorted(allowed)

    meta.write_text(json.dumps({"kind": "draft", "draft_vocab": [0, 10 ** 6]}))
    with pytest.raises(ValueError, match="draft_vocab"):
        LLM(llama_path, dtype="float32", num_threads=1, speculator=str(draft))


@pytest.mark.parametrize("rows", [3, 6])  # int8 copies up to 4 rows, the dense ones past
def test_head_layer_in_one_call_is_its_ops(llama_path, head_path, rows):
    """A bf16 head's layer runs as one `kiln::llama_stack` call, the target's own kernels: h
    within bf16 rounding of the same layer's ops one by one (which rotate in bf16, the kernel
    from fp32 tables), the same KV written, the same likeliest drafts at almost every row, for
    a round's draft rows and for a catch-up's several positions of one sequence. Greedy
    output stays the target's."""
    from kiln.models.layers.attention import SeqLayout

    llm = LLM(llama_path, dtype="bfloat16", num_threads=1, speculator=head_path,
              speculative_config=FORCED)
    proposer = llm.engine.speculator.proposer
    if proposer.stack is None:
        pytest.skip("kiln's C++ kernels or oneDNN bf16 packing are not available here")
    torch.manual_seed(0)
    for t in proposer.kv:
        t[:64].normal_()
    hidden = proposer.head.c.hidden_size
    ctx_len, tables = torch.tensor([21]), torch.tensor([[2, 0, 1]])
    draft_step = proposer._rows(ctx_len, tables, rows, rows, 2).layout(0)
    catch_up = SeqLayout(torch.tensor([0]), torch.tensor([rows]), torch.tensor([21 - rows]),
                         tables)
    for layout, positions, slots in (draft_step, (catch_up, torch.arange(21 - rows, 21), None)):
        meta = proposer.paged.build_metadata(layout, positions, proposer.block_size, slots)
        g = torch.randn(rows, hidden, dtype=torch.bfloat16)
        tokens = torch.randint(0, 256, (rows,))
        before = [t.clone() for t in proposer.kv]
        fused, fused_normed = proposer._forward(g, tokens, positions, meta)
        fused_kv = [t.clone() for t in proposer.kv]
        for t, b in zip(proposer.kv, before, strict=True):
            t.copy_(b)
        stack, proposer.stack = proposer.stack, None
        ops, ops_normed = proposer._forward(g, tokens, positions, meta)
        proposer.stack = stack
        assert (fused.float() - ops.float()).abs().max() <= 0.03 * ops.float().abs().max()
        for a, b, old in zip(fused_kv, proposer.kv, before, strict=True):
            assert (a.float() - b.float()).abs().max() <= 0.03 * b.float().abs().max()
            assert not torch.equal(a, old)  # written
        agree = proposer._pick(fused_normed) == proposer._pick(ops_normed)
        assert agree.float().mean() >= 0.8
    bf16 = LLM(llama_path, dtype="bfloat16", num_threads=1)
    ps = prompts(llm.get_tokenizer())
    assert (ids(llm.generate(ps, greedy(), use_tqdm=False))
            == ids(bf16.generate(ps, greedy(), use_tqdm=False)))


def test_head_that_never_drafts_never_runs(reference, llama_path, head_path):
    """With drafting switched off throughout, the head does no catch-up work at a request's
    end: its KV stays zero (no head forward ran), and the next run, with prefix hits and
    drafting on, is still lossless."""
    _, ps, params, expected = reference
    llm = LLM(llama_path, dtype="float32", num_threads=1, speculator=head_path,
              speculative_config=FORCED)
    spec = llm.engine.speculator
    forced = spec.adaptive.choose
    spec.adaptive.choose = lambda batch, ids=(), left=None: 0
    assert ids(llm.generate(ps, params, use_tqdm=False)) == expected
    head = spec.proposer
    assert not head.pending and not head.drafted
    assert not head.kv[0].any() and not head.kv[1].any()
    spec.adaptive.choose = forced
    assert ids(llm.generate(ps, params, use_tqdm=False)) == expected
    assert spec.stats.num_draft_tokens > 0 and llm.engine.kv.stats().hit_tokens > 0
    assert head.kv[0].any()


def test_adaptive_speculation_is_lossless_too(reference, llama_path, draft_path):
    _, ps, params, expected = reference
    llm = LLM(llama_path, dtype="float32", num_threads=1, speculator=draft_path)
    assert ids(llm.generate(ps, params, use_tqdm=False)) == expected


def test_drafts_never_run_past_max_tokens_or_stop_tokens(reference, llama_path):
    llm, ps, _, _ = reference
    spec = LLM(llama_path, dtype="float32", num_threads=1, speculator=llama_path,
               speculative_config=FORCED)  # all drafts accepted: 4 tokens per step
    for max_tokens in (1, 2, 5, 6):
        out = spec.generate(ps[:2], greedy(max_tokens=max_tokens), use_tqdm=False)
        assert [len(t) for t in ids(out)] == [max_tokens] * 2
        assert all(o.outputs[0].finish_reason == "length" for o in out)
    base = ids(llm.generate(ps[:1], greedy(max_tokens=20), use_tqdm=False))[0]
    stop = base[5]
    for engine in (llm, spec):
        out = engine.generate(ps[:1], greedy(max_tokens=20, stop_token_ids=[stop]),
                              use_tqdm=False)[0].outputs[0]
        assert out.token_ids == base[:base.index(stop) + 1] and out.finish_reason == "stop"
        assert out.stop_reason == stop


def test_stop_strings_n_greater_than_one_and_preemption(reference, llama_path, draft_path):
    llm, ps, _, _ = reference
    tok = llm.get_tokenizer()
    text = llm.generate(ps[:1], greedy(max_tokens=20), use_tqdm=False)[0].outputs[0].text
    stop = text[8:11]
    params = greedy(max_tokens=20, stop=[stop], n=2)
    want = llm.generate(ps[:1], params, use_tqdm=False)[0]
    spec = LLM(llama_path, dtype="float32", num_threads=1, speculator=draft_path,
               speculative_config=FORCED,
               kv_cache_memory=6 * llm.engine.runner.kv_spec.bytes_per_block)
    got = spec.generate(ps[:1] * 2, params, use_tqdm=False)
    for out in got:
        assert [c.text for c in out.outputs] == [c.text for c in want.outputs]
        assert all(c.finish_reason == "stop" and stop not in c.text for c in out.outputs)
    long = greedy(max_tokens=40)
    assert ids(spec.generate(ps, long, use_tqdm=False)) == ids(
        llm.generate(ps, long, use_tqdm=False))
    assert spec.engine.scheduler.num_preemptions > 0
    assert tok is not None


def test_head_drafts_read_the_same_kv_after_prefix_cache_hits(llama_path, head_path):
    """The head's KV lives in the target's blocks: a cache hit must hand over head KV that
    gives exactly the drafts a full computation gives."""
    seen: dict[str, list[list[int]]] = {}

    def run(caching: bool) -> list[list[list[int]]]:
        llm = LLM(llama_path, dtype="float32", num_threads=1, speculator=head_path,
                  speculative_config=FORCED, enable_prefix_caching=caching)
        proposer = llm.engine.speculator.proposer
        original = proposer.propose

        def recording(sched, wanted):
            drafts = original(sched, wanted)
            for w, d in zip(wanted, drafts, strict=True):
                seen.setdefault(w.request.request_id, []).append(d.token_ids)
            return drafts

        proposer.propose = recording
        ps = prompts(llm.get_tokenizer())[:1]
        llm.generate(ps, greedy(max_tokens=12), use_tqdm=False)
        seen.clear()
        out = llm.generate(ps, greedy(max_tokens=12), use_tqdm=False)
        assert (out[0].num_cached_tokens > 0) == caching
        return list(seen.values())

    assert run(True) == run(False)


def test_draft_model_cache_stays_exact_across_rollbacks(reference, llama_path, draft_path):
    """Every proposal equals the draft model's own greedy continuation of the verified
    tokens, computed from scratch: the draft's paged KV (kept across partial acceptances,
    trims and prefix-cache hits) never holds a rejected token."""
    _, ps, params, _ = reference
    spec = LLM(llama_path, dtype="float32", num_threads=1, speculator=draft_path,
               speculative_config=EXACT)
    proposer = spec.engine.speculator.proposer
    proposals, original = [], proposer.propose

    def recording(sched, wanted):
        drafts = original(sched, wanted)
        proposals.extend((list(w.request.all_token_ids), d.token_ids)
                         for w, d in zip(wanted, drafts, strict=True))
        return drafts

    proposer.propose = recording
    spec.generate(ps[:3], params[:3], use_tqdm=False)
    spec.generate(ps[:3], params[:3], use_tqdm=False)  # shadows re-admitted via cache hits
    assert proposer.kv.stats().hit_tokens > 0
    draft = LLM(draft_path, dtype="float32", num_threads=1, enable_prefix_caching=False)
    fresh = draft.generate([{"prompt_token_ids": t} for t, _ in proposals],
                           [greedy(max_tokens=len(d)) for _, d in proposals], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in fresh] == [d for _, d in proposals]
    stats = spec.engine.speculator.stats
    assert stats.num_accepted_tokens < stats.num_draft_tokens  # rollbacks happened


# -- sampling keeps the target distribution -------------------------------------------------


@register_proposer("test-sampled")
class SampledDraftProposer:
    """Drafts drawn from a fixed, deliberately wrong distribution q (and reports q)."""

    def __init__(self, config, ctx):
        self.vocab = ctx.target.vocab_size
        self.gen = torch.Generator().manual_seed(1)

    def propose(self, sched, wanted):
        out = []
        for w in wanted:
            q = torch.full((w.max_drafts, self.vocab), 0.2 / self.vocab)
            q[:, :8] += 0.8 / 8  # mass on tokens 0..7
            tokens = torch.multinomial(q, 1, generator=self.gen).view(-1).tolist()
            out.append(Draft(tokens, q))
        return out

    def release(self, request_ids):
        pass


CHI2_999 = {3: 16.27, 8: 26.12, 15: 37.70, 24: 51.18, 26: 54.05}


def exact_pairs(llm, prompt: list[int], top_k: int, temperature: float) -> dict:
    """P(t1, t2) under top-k sampling, from the target's own logprobs."""
    def dist(ids):
        out = llm.generate({"prompt_token_ids": ids},
                           SamplingParams(temperature=0, max_tokens=1, logprobs=top_k),
                           use_tqdm=False)[0].outputs[0].logprobs[0]
        top = sorted(out.items(), key=lambda kv: -kv[1].logprob)[:top_k]
        z = sum(math.exp(lp.logprob / temperature) for _, lp in top)
        return {t: math.exp(lp.logprob / temperature) / z for t, lp in top}

    return {(a, b): pa * pb for a, pa in dist(prompt).items()
            for b, pb in dist(prompt + [a]).items()}


def assert_sampled_like(spec, prompt: list[int], exact: dict, top_k: int, temperature: float,
                        n: int) -> None:
    """n seeded samples of 4 tokens: the frequencies of their leading tuples (the length of
    `exact`'s keys) pass a chi-square test against `exact`."""
    params = [SamplingParams(temperature=temperature, top_k=top_k, max_tokens=4, seed=i,
                             ignore_eos=True) for i in range(n)]
    outs = spec.generate([{"prompt_token_ids": prompt}] * n, params, use_tqdm=False)
    length = len(next(iter(exact)))
    counts = {key: 0 for key in exact}
    for o in outs:
        counts[tuple(o.outputs[0].token_ids[:length])] += 1
    stat = sum((counts[t] - n * q) ** 2 / (n * q) for t, q in exact.items())
    assert stat < CHI2_999[len(exact) - 1], (counts, exact)


@pytest.mark.parametrize("proposer", ["draft", "test-sampled"])
def test_sampled_outputs_keep_the_target_distribution(proposer, reference, llama_path,
                                                      draft_path):
    llm, ps, _, _ = reference
    prompt = ps[3]["prompt_token_ids"]
    top_k, temperature, n = 3, 1.5, 1200
    exact = exact_pairs(llm, prompt, top_k, temperature)
    config = (SpeculativeConfig(method="test-sampled", adaptive=False) if proposer != "draft"
              else FORCED)
    spec = LLM(llama_path, dtype="float32", num_threads=1, max_num_seqs=256,
               speculator=draft_path if proposer == "draft" else None,
               speculative_config=config)
    assert_sampled_like(spec, prompt, exact, top_k, temperature, n)
    stats = spec.engine.speculator.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # both paths taken


def test_unknown_proposer_is_named(llama_path):
    with pytest.raises(ValueError, match="unknown speculative method 'nope'; known: .*ngram"):
        LLM(llama_path, dtype="float32", num_threads=1,
            speculative_config=SpeculativeConfig(method="nope"))


# -- draft trees ----------------------------------------------------------------------------

ORACLE: dict[tuple[int, ...], list[int]] = {}  # prompt -> the target's greedy continuation


@register_proposer("test-tree")
class OracleTreeProposer:
    """Trees that hide the target's next tokens among wrong ones: at each level the right
    child is first, second or missing, so paths through later branches get accepted (and
    their KV moved into place) as often as the first branch or none."""

    def __init__(self, config, ctx):
        self.vocab = ctx.target.vocab_size
        self.gen = torch.Generator().manual_seed(3)

    def _rand(self, n: int) -> int:
        return int(torch.randint(n, (1,), generator=self.gen))

    def propose(self, sched, wanted):
        out = []
        for w in wanted:
            r = w.request
            truth = ORACLE[tuple(r.prompt_token_ids)][len(r.output_token_ids):]
            tokens, parents, node = [], [], -1
            for depth in range(min(w.max_drafts, len(truth))):
                wrong = (truth[depth] + 1 + self._rand(self.vocab - 1)) % self.vocab
                order = [[wrong, truth[depth]], [truth[depth], wrong], [wrong]][self._rand(3)]
                right = None
                for token in order:
                    tokens.append(token)
                    parents.append(node)
                    if token == truth[depth]:
                        right = len(tokens) - 1
                    elif depth + 1 < w.max_drafts:  # a wrong branch grows a child too
                        tokens.append(self._rand(self.vocab))
                        parents.append(len(tokens) - 2)
                if right is None:
                    break
                node = right
            out.append(Draft(tokens, None, parents) if tokens else Draft())
        return out

    def release(self, request_ids):
        pass


@pytest.mark.parametrize("kernels", ["auto", "torch"])  # C++ attention, reference attention
def test_greedy_is_token_identical_with_draft_trees(kernels, reference, llama_path):
    _, ps, params, expected = reference
    for p, e in zip(ps, expected, strict=True):
        ORACLE[tuple(p["prompt_token_ids"])] = e
    llm = LLM(llama_path, dtype="float32", num_threads=1, max_num_batched_tokens=48,
              kernels=kernels,
              speculative_config=SpeculativeConfig(method="test-tree", adaptive=False))
    first = llm.generate(ps, params, use_tqdm=False)
    again = llm.generate(ps, params, use_tqdm=False)  # prefix-cache hits on moved KV
    assert ids(first) == expected and ids(again) == expected
    stats = llm.engine.speculator.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    # more than one draft per position: trees, and paths that left the first branch
    assert stats.num_draft_tokens > 3 * stats.num_verify_steps // 2
    assert llm.engine.kv.stats().used_blocks == 0 and llm.engine.kv.stats().hit_tokens > 0


def test_ngram_trees_are_lossless_and_draft_several_continuations(reference, llama_path):
    _, ps, params, expected = reference
    llm = LLM(llama_path, dtype="float32", num_threads=1, max_num_batched_tokens=48,
              speculator="ngram",
              speculative_config=SpeculativeConfig(adaptive=False, tree_width=3,
                                                   tree_max_batch=8))
    outs = llm.generate(ps, params, use_tqdm=False)
    assert ids(outs) == expected
    metrics = [o.metrics for o in outs if o.metrics]
    drafted = sum(m["num_draft_tokens"] for m in metrics)
    positions = sum(sum(m["drafted_per_position"]) for m in metrics)
    assert drafted > positions  # some steps verified more drafts than positions


LIKELY: dict[tuple[int, ...], list[int]] = {}  # context -> the target's top tokens after it


@register_proposer("test-tree-sampled")
class LikelyTreeProposer:
    """Trees of one-hot drafts over the target's likely tokens: two of its top three (in
    random order) and a wrong one at the root, two likely ones under each of those."""

    def __init__(self, config, ctx):
        self.gen = torch.Generator().manual_seed(5)

    def _pick(self, options: list[int], n: int) -> list[int]:
        order = torch.randperm(len(options), generator=self.gen)[:n].tolist()
        return [options[i] for i in order]

    def propose(self, sched, wanted):
        out = []
        for w in wanted:
            context = tuple(w.request.all_token_ids)
            if context not in LIKELY or w.max_drafts < 2:
                out.append(Draft())
                continue
            tokens, parents = [], []
            for first in self._pick(LIKELY[context], 2) + [max(LIKELY[context]) + 1]:
                tokens.append(first)
                parents.append(-1)
                node = len(tokens) - 1
                for second in self._pick(LIKELY.get(context + (first,), []), 2):
                    tokens.append(second)
                    parents.append(node)
            out.append(Draft(tokens, None, parents))
        return out

    def release(self, request_ids):
        pass


def test_sampled_outputs_keep_the_target_distribution_with_trees(reference, llama_path):
    """Tokens 2 and 3 come out of trees (token 1 is the prefill's): the triples' frequencies
    against the target's own distribution."""
    llm, ps, _, _ = reference
    prompt = ps[3]["prompt_token_ids"]
    top_k, temperature, n = 3, 1.5, 1500
    pairs = exact_pairs(llm, prompt, top_k, temperature)
    exact = {}
    for a in sorted({a for a, _ in pairs}):
        after = exact_pairs(llm, prompt + [a], top_k, temperature)
        p_a = sum(q for (x, _), q in pairs.items() if x == a)
        exact.update({(a, b, c): p_a * q for (b, c), q in after.items()})
        LIKELY[tuple(prompt) + (a,)] = sorted({b for b, _ in after})
        for b in LIKELY[tuple(prompt) + (a,)]:
            LIKELY[tuple(prompt) + (a, b)] = sorted({c for x, c in after if x == b})
    spec = LLM(llama_path, dtype="float32", num_threads=1, max_num_seqs=256,
               speculative_config=SpeculativeConfig(method="test-tree-sampled", adaptive=False))
    assert_sampled_like(spec, prompt, exact, top_k, temperature, n)
    stats = spec.engine.speculator.stats
    assert stats.num_accepted_tokens > n  # mostly accepted: the trees hold likely tokens
    assert stats.num_draft_tokens > 3 * stats.num_verify_steps


def placed_trees(monkeypatch) -> list:
    """The scheduled items whose draft trees the runner lays out, as it lays them out."""
    import kiln.runner.batch as batch

    placed = []
    real = batch._place_tree
    monkeypatch.setattr(batch, "_place_tree", lambda item, *a: placed.append(item)
                        or real(item, *a))
    return placed


@pytest.mark.parametrize("ngram_first", [False, True])
def test_head_trees_are_lossless(ngram_first, reference, llama_path, head_path, monkeypatch):
    """The head's dynamic trees (and with ngram_first, lookup's trees where a match pays,
    merged into the head's where one is passed over for it): greedy output unchanged,
    branching trees verified."""
    _, ps, params, expected = reference
    placed = placed_trees(monkeypatch)
    llm = LLM(llama_path, dtype="float32", num_threads=1, max_num_batched_tokens=48,
              speculator=head_path, speculative_config=SpeculativeConfig(
                  adaptive=False, tree_width=2, tree_min_prob=0.0, ngram_first=ngram_first,
                  tree_max_batch=2))
    if ngram_first:  # chains: one-token matches to the head, longer to lookup (trees with k
        # fixed: every match joins the head's tree)
        llm.engine.speculator.routing.prefers_lookup = lambda match, costs: match.length > 1
    shapes = []
    real_shape = llm.engine.speculator.tree_step
    llm.engine.speculator.tree_step = lambda batch: shapes.append(
        (batch, real_shape(batch))) or shapes[-1][1]
    assert ids(llm.generate(ps, params, use_tqdm=False)) == expected
    trees = [item.draft_parents for item in placed]
    assert any(t.count(-1) == 2 for t in trees)  # the head's two first drafts
    assert all(max(tree_depths(t)) <= 3 for t in trees)
    sizes = {len(t) for t in trees}
    # the head's 3 * 2 likeliest nodes; merged with lookup's continuations, more
    assert (max(sizes) > 6) if ngram_first else (max(sizes) == 6)
    assert not ngram_first or any(t.count(-1) > 2 for t in trees)  # lookup's own first draft
    # trees while at most tree_max_batch sequences decode, chains in the full batch
    assert {(b > 2, tree) for b, tree in shapes if b} == {(True, None), (False, True)}


def test_with_k_fixed_a_match_joins_the_head_tree_however_lookup_has_paid(
        reference, llama_path, head_path):
    """Without adaptive speculation (costs not weighed) the more often right source drafts:
    in a tree step that is the head's tree with the match's first continuation in it, so
    every match joins it even where lookup's record says lookup alone pays (here always);
    in chain steps (more sequences than tree_max_batch) the record still routes. Output
    unchanged."""
    _, ps, params, expected = reference
    llm = LLM(llama_path, dtype="float32", num_threads=1, speculator=head_path,
              speculative_config=SpeculativeConfig(adaptive=False, tree_width=2,
                                                   ngram_first=True, tree_max_batch=2))
    spec = llm.engine.speculator
    routing = spec.routing
    routing.prefers_lookup = lambda match, costs: True
    steps, inner = [], routing.route

    def route(step, preferred, model_drafts):
        decided = inner(step, preferred, model_drafts)
        steps.append((step.tree, len(step.matches), len(decided.lookup)))
        return decided

    routing.route = route
    assert ids(llm.generate(ps, params, use_tqdm=False)) == expected  # trees late, chains
    one = [llm.generate([p], [sp], use_tqdm=False)[0] for p, sp in zip(ps, params, strict=True)]
    assert ids(one) == expected  # trees throughout
    trees = [(matched, alone) for tree, matched, alone in steps if tree]
    chains = [(matched, alone) for tree, matched, alone in steps if not tree]
    assert any(matched for matched, _ in trees) and not any(alone for _, alone in trees)
    assert any(alone for _, alone in chains)


def test_a_head_drafts_trees_with_lookup_joined_by_default(reference, llama_path, head_path,
                                                          monkeypatch):
    """Named with nothing else set, a head drafts trees from a HEAD_TREE_WIDTH-wide beam,
    its nodes of path probability >= HEAD_TREE_MIN_PROB up to HEAD_TREE_DRAFTS, where one
    sequence decodes (chains above: tree_max_batch 1), lookup's matches joining them; greedy
    output unchanged."""
    _, ps, params, expected = reference
    placed = placed_trees(monkeypatch)
    llm = LLM(llama_path, dtype="float32", num_threads=1, speculator=head_path,
              speculative_config=SpeculativeConfig(adaptive=False))
    spec = llm.engine.speculator
    assert (spec.config.tree_width, spec.config.tree_size, spec.config.ngram_first,
            spec.config.tree_max_batch, spec.config.tree_min_prob) == (
                HEAD_TREE_WIDTH, HEAD_TREE_DRAFTS, True, 1, HEAD_TREE_MIN_PROB)
    assert spec.proposer.min_prob == HEAD_TREE_MIN_PROB
    assert spec.lookup is not None
    widths, real = [], spec.proposer._tree_nodes
    spec.proposer._tree_nodes = lambda *a: widths.append(a[-1]) or real(*a)
    one = [llm.generate([p], [sp], use_tqdm=False)[0] for p, sp in zip(ps, params, strict=True)]
    assert ids(one) == expected
    trees = [item.draft_parents for item in placed]
    assert trees and set(widths) == {HEAD_TREE_WIDTH}
    assert max(len(t) for t in trees) <= HEAD_TREE_DRAFTS


@pytest.mark.parametrize("kernels", ["auto", "torch"])  # C++ attention, reference attention
def test_trees_of_up_to_31_drafts_are_lossless(kernels, reference, llama_path, head_path,
                                               monkeypatch):
    """The head's tree 8 wide with lookup merged in: queries of up to 32 tokens, past the
    C++ short-query kernel's 16-token chunks (trees stay in it for their bits)."""
    _, ps, params, expected = reference
    placed = placed_trees(monkeypatch)
    llm = LLM(llama_path, dtype="float32", num_threads=1, max_num_batched_tokens=128,
              kernels=kernels, speculator=head_path, speculative_config=SpeculativeConfig(
                  adaptive=False, tree_width=8, tree_size=31, tree_min_prob=0.0, ngram_first=True,
                  tree_max_batch=8))
    llm.engine.speculator.routing.prefers_lookup = lambda match, costs: False  # all merge
    assert ids(llm.generate(ps, params, use_tqdm=False)) == expected
    sizes = {item.num_draft_tokens for item in placed}
    assert 15 < max(sizes) <= 31 and len(sizes) > 1


def test_a_full_merged_tree_keeps_lookups_first_continuation_whole(reference, llama_path,
                                                                   head_path):
    """A match passed over for the head joins its tree ahead of it: when the head's nodes
    alone fill the tree (2 wide, 3 deep: 6 of 6), lookup's first continuation is still a
    path from the root, and the head keeps what room is left; greedy output unchanged."""
    _, ps, params, expected = reference
    llm = LLM(llama_path, dtype="float32", num_threads=1, speculator=head_path,
              speculative_config=SpeculativeConfig(adaptive=False, tree_width=2, tree_size=6,
                                                   tree_min_prob=0.0, ngram_first=True,
                                                   tree_max_batch=8))
    spec, merged = llm.engine.speculator, []
    spec.routing.prefers_lookup = lambda match, costs: False  # every match merges
    real = spec.routing.join
    spec.routing.join = lambda lookup, model, depth: merged.append(
        (lookup, model, depth, real(lookup, model, depth))) or merged[-1][-1]
    assert ids(llm.generate(ps, params, use_tqdm=False)) == expected

    def has_path(tree, tokens) -> bool:  # `tokens` a path down from the root of `tree`
        trie, node = DraftTrie(MAX_TREE_DRAFTS), -1
        trie.add_draft(tree)
        for token in tokens:
            if (node := trie.children.get((node, token))) is None:
                return False
        return True

    full = [(lk, m, d, out) for lk, m, d, out in merged if lk is not None and lk.token_ids
            and len(m.token_ids) == 6]
    assert full  # the head filled the tree and lookup had a match
    for lookup, model, depth, out in full:
        first = lookup.limit(depth, 6).main_chain().token_ids
        assert len(out.token_ids) == 6 and has_path(out, first)
        assert has_path(out, model.main_chain().token_ids[:1])  # the head's likeliest draft
    assert any(not set(o.token_ids) <= set(m.token_ids) for _, m, _, o in full)


def test_head_trees_by_probability_are_lossless(reference, llama_path, head_path):
    """tree_min_prob: each step's head tree holds exactly the beam's nodes whose path
    probability reaches the floor (at least one, at most tree_size), so trees differ in size
    from step to step; greedy output unchanged. The floor is the median path probability
    this head gives its nodes without one."""
    _, ps, params, expected = reference
    llm = LLM(llama_path, dtype="float32", num_threads=1, speculator=head_path,
              speculative_config=SpeculativeConfig(adaptive=False, tree_width=4, tree_size=20,
                                                   tree_min_prob=0.5, ngram_first=False,
                                                   tree_max_batch=8))
    proposer = llm.engine.speculator.proposer
    real_nodes, real_tree = proposer._tree_nodes, proposer._tree
    seen, trees = [], []
    proposer._tree_nodes = lambda *a: seen.append(real_nodes(*a)) or seen[-1]
    proposer._tree = lambda *a: trees.append(real_tree(*a)) or trees[-1]
    proposer.min_prob = None  # a first pass without the floor: the 3 * 4 likeliest nodes
    assert ids(llm.generate(ps, params, use_tqdm=False)) == expected
    assert max(len(d.token_ids) for t in trees for d in t) == 12
    lps = sorted(lp for batch in seen for nodes in batch for lp, *_ in nodes)
    floor = math.exp(lps[len(lps) // 2])
    seen.clear()
    trees.clear()
    proposer.min_prob = floor
    assert ids(llm.generate(ps, params, use_tqdm=False)) == expected
    sizes = []
    for batch, drafts in zip(seen, trees, strict=True):
        for nodes, draft in zip(batch, drafts, strict=True):
            above = sum(1 for lp, *_ in nodes if lp >= math.log(floor))
            assert len(draft.token_ids) == max(1, min(20, above))
            sizes.append(len(draft.token_ids))
    assert len(set(sizes)) > 2 and max(sizes) > 12  # more than the fixed 12 where it is sure


def test_the_verify_shortlist_scores_fewer_rows_and_changes_no_token(reference, llama_path,
                                                                     head_path):
    """verify_shortlist (the default): greedy verify steps score the whole vocabulary only on
    the rows the walk visits, the head's draft vocabulary guessing the others' choices. The
    output is the same as without it, with far fewer rows through the LM head."""
    _, ps, params, expected = reference
    scored = {}
    for on in (True, False):
        llm = LLM(llama_path, dtype="float32", num_threads=1, speculator=head_path,
                  speculative_config=SpeculativeConfig(
                      adaptive=False, tree_width=4, tree_size=12, tree_min_prob=0.0,
                      tree_max_batch=8, verify_shortlist=on))
        runner, rows = llm.engine.runner, []
        assert (runner.shortlist is not None) == on
        real = runner.model.compute_logits
        runner.model.compute_logits = lambda h, real=real, rows=rows: rows.append(len(h)) or real(h)
        assert ids(llm.generate(ps, params, use_tqdm=False)) == expected
        scored[on] = sum(rows)
    assert scored[True] < scored[False] / 2


def test_a_tree_by_probability_leaves_lookups_other_continuations_out(llama_path, head_path):
    """With tree_min_prob a merged tree holds lookup's first continuation and the head's
    nodes, not lookup's other continuations (at 0, a fixed tree, they fill the room left)."""
    lookup = Draft([1, 2, 3, 7, 8], None, [-1, 0, 1, -1, 3])  # two continuations: 1 2 3, 7 8
    model = Draft([4, 5, 6], None, [-1, 0, -1])
    merged = {}
    for floor in (0.0, 0.02):
        llm = LLM(llama_path, dtype="float32", num_threads=1, speculator=head_path,
                  speculative_config=SpeculativeConfig(adaptive=False, tree_width=2,
                                                       tree_size=12, tree_min_prob=floor))
        merged[floor] = llm.engine.speculator.routing.join(lookup, model, 3)
    assert merged[0.0] == Draft([1, 2, 3, 4, 5, 6, 7, 8], None, [-1, 0, 1, -1, 3, -1, -1, 6])
    assert merged[0.02] == Draft([1, 2, 3, 4, 5, 6], None, [-1, 0, 1, -1, 3, -1])


@pytest.mark.parametrize("ngram_first", [False, True])
def test_adaptive_trees_measure_trees_and_chains_and_stay_lossless(ngram_first, reference,
                                                                   llama_path, head_path):
    """With adaptive speculation, tree steps have controllers of their own (sharing the
    baseline) and `shape` measures both shapes before choosing; greedy output unchanged."""
    _, ps, params, expected = reference
    llm = LLM(llama_path, dtype="float32", num_threads=1, speculator=head_path,
              speculative_config=SpeculativeConfig(tree_width=3, tree_max_batch=8,
                                                   ngram_first=ngram_first))
    spec = llm.engine.speculator
    spec.shape.warmup = 3  # both shapes within this short run
    assert ids(llm.generate(ps, params, use_tqdm=False)) == expected
    tree_model = spec.trees.model.controller
    tree_lookup = spec.trees.lookup and spec.trees.lookup.controller
    assert tree_model is not spec.adaptive and tree_model.shares_baseline(spec.adaptive)
    assert (tree_lookup is not None) == ngram_first
    assert tree_lookup is None or tree_lookup is not spec.lookup
    assert spec.shape.observations(True) >= 3 and spec.shape.observations(False) >= 3
    for shape in ((tree_model, tree_lookup), (spec.adaptive, spec.lookup)):
        assert any(c is not None and c.verifications > 0 for c in shape)  # drafts verified
    assert llm.engine.kv.stats().used_blocks == 0


def test_head_tree_is_its_beam_search(reference, llama_path, head_path):
    """The head's tree nodes are the beam search they claim to be: each node's score is its
    path's log-likelihood found by running the head along that path alone (a round of one
    row, one token at a time), and the nodes are the children of the `width` likeliest
    paths at each depth (the rows batched over the beams attend each one's own ancestors)
    whose path probability reaches the floor. Expanding only those keeps the tree the whole
    beam search would give."""
    _, ps, params, _ = reference
    llm = LLM(llama_path, dtype="float32", num_threads=1, speculator=head_path,
              speculative_config=SpeculativeConfig(adaptive=False, tree_width=3))
    proposer = llm.engine.speculator.proposer
    floor = math.log(proposer.min_prob)
    real, checked = proposer._tree_nodes, []

    def path_scores(h, normed, ctx_len, tables, depth, width, prune) -> dict[tuple, float]:
        def top_after(path):  # the head along `path` alone, from the root's h
            rows = proposer._rows(ctx_len[:1], tables[:1], 1, 1, depth)
            x, x_normed = h[:1], normed[:1]
            for j, t in enumerate(path):
                x, x_normed = proposer._step(rows, x, torch.tensor([t]), j)
            logp, tokens = proposer._top(x_normed, width)
            return zip(logp[0].tolist(), tokens[0].tolist(), strict=True)

        frontier, scores = [((), 0.0)], {}
        for _ in range(depth):
            expanded = [(path + (t,), s + lp) for path, s in frontier
                        for lp, t in top_after(path)]
            scores.update(expanded)
            frontier = sorted(expanded, key=lambda c: -c[1])[:width]
            frontier = [c for c in frontier if c[1] >= floor or not prune]
        return scores

    def kept(scores: dict[tuple, float]) -> set[tuple]:  # the tree's rule on path scores
        count = max(1, min(proposer.tree_size, sum(1 for s in scores.values() if s >= floor)))
        return set(sorted(scores, key=lambda p: (-scores[p], len(p)))[:count])

    def tree_nodes(h, normed, ctx_len, tables, depth, width):
        out = real(h, normed, ctx_len, tables, depth, width)
        scores = path_scores(h, normed, ctx_len, tables, depth, width, prune=True)
        paths = []
        for score, _, token, parent in out[0]:
            paths.append((paths[parent] if parent >= 0 else ()) + (token,))
            assert score == pytest.approx(scores[paths[-1]], abs=1e-4)
        assert set(paths) == set(scores)  # the same nodes expanded
        full = path_scores(h, normed, ctx_len, tables, depth, width, prune=False)
        checked.append((depth, len(full) > len(scores)))
        assert kept(scores) == kept(full)
        return out

    proposer._tree_nodes = tree_nodes
    llm.generate(ps[:1], params[:1], use_tqdm=False)
    assert (3, True) in checked and len(checked) > 3  # some beams were left unexpanded
