"""The repetition guard in the engine, on a crafted checkpoint whose weights make one word token
win after any input (a model stuck in a loop): stop, retry, off, per request and by default."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln import LLM, SamplingParams
from kiln.sampling_params import RepetitionGuardParams

LOOP_TEXT = " the"  # the token the looping model always prefers


def make_looping_checkpoint(path: Path) -> tuple[Path, int]:
    """A tiny untied-embedding model whose hidden state is the same after every input, with
    the LM-head row of one word token aligned to it: that token always wins (greedy), and is
    by far the most likely (sampled). Returns (path, the token id)."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    from kiln.testing.tiny import make_tiny_checkpoint

    path = make_tiny_checkpoint(path, "mistral")
    token = AutoTokenizer.from_pretrained(path).convert_tokens_to_ids(
        AutoTokenizer.from_pretrained(path).tokenize(LOOP_TEXT))[0]
    weights = load_file(path / "model.safetensors")
    for name, w in weights.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            w.zero_()  # the layers add nothing: the residual stream is the embedding
    embed = weights["model.embed_tokens.weight"]
    embed.copy_(torch.ones_like(embed))  # every input embeds the same
    hidden = weights["model.norm.weight"]  # = RMSNorm(ones) * weight
    weights["lm_head.weight"][token] = 2.0 * hidden
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path, token


@pytest.fixture(scope="session")
def looping_model(tmp_path_factory) -> tuple[str, int]:
    path, token = make_looping_checkpoint(tmp_path_factory.mktemp("looping"))
    return str(path), token


@pytest.fixture(scope="module")
def looping_llm(looping_model):
    return LLM(looping_model[0], dtype="float32", kv_cache_memory=8 << 20, num_threads=1)


def _run(llm, **params):
    return llm.generate("Once upon a time", SamplingParams(max_tokens=64, **params),
                        use_tqdm=False)[0].outputs[0]


def test_the_guard_stops_a_loop_at_the_fourth_token(looping_llm, looping_model):
    out = _run(looping_llm, temperature=0)
    assert out.finish_reason == "repetition"
    assert out.token_ids == [looping_model[1]] * 4


def test_retry_redraws_the_looping_token_once_then_stops(looping_model):
    llm = LLM(looping_model[0], dtype="float32", kv_cache_memory=8 << 20, num_threads=1,
              repetition_guard="retry")
    token = looping_model[1]
    for params in ({"temperature": 0}, {"temperature": 0.8, "seed": 5}):
        out = _run(llm, **params)
        assert out.finish_reason == "repetition"
        # three of the loop, the redrawn one (anything else), then four more: stop
        assert out.token_ids[:3] == [token] * 3 and out.token_ids[3] != token
        assert out.token_ids[4:] == [token] * 4
    assert llm.engine.structured.num_redraws == 2


def test_per_request_settings_override_the_engine(looping_llm, looping_model):
    off = _run(looping_llm, temperature=0,
               repetition_guard=RepetitionGuardParams(mode="off"))
    assert off.finish_reason == "length" and len(off.token_ids) == 64
    longer = _run(looping_llm, temperature=0,
                  repetition_guard=RepetitionGuardParams(token_run=10))
    assert longer.finish_reason == "repetition" and len(longer.token_ids) == 10


def test_ignore_eos_turns_the_default_guard_off(looping_llm):
    out = _run(looping_llm, temperature=0, ignore_eos=True)
    assert out.finish_reason == "length" and len(out.token_ids) == 64
    named = _run(looping_llm, temperature=0, ignore_eos=True,
                 repetition_guard=RepetitionGuardParams(mode="stop"))
    assert named.finish_reason == "repetition"


def test_every_child_of_n_is_guarded_and_the_prefix_cache_still_hits(looping_llm):
    prompt = "The quick brown fox jumps over the lazy dog. " * 3
    params = SamplingParams(n=3, temperature=0.5, seed=1, max_tokens=64)
    first, second = (looping_llm.generate(prompt, params, use_tqdm=False)[0] for _ in range(2))
    assert second.num_cached_tokens >= 16
    assert all(o.finish_reason == "repetition" for o in first.outputs + second.outputs)


def test_the_engine_trips_exactly_where_the_rules_say(tiny_llm):
    """Sampled text of the random tiny model: with the guard on, each output is the
    unguarded one cut at the first token `find_loop` flags (if any), nothing else changes."""
    from kiln.structured.guard import find_loop, guard_settings

    outs = tiny_llm.generate(["The quick brown fox", "def add(a, b):", "Paris is"],
                             SamplingParams(temperature=1.0, seed=3, max_tokens=48,
                                            repetition_guard=RepetitionGuardParams(
                                                mode="off")), use_tqdm=False)
    filler = tiny_llm.engine.structured.vocab().filler
    settings = guard_settings(None, "stop")
    for out in outs:
        ids = out.outputs[0].token_ids
        trips = [i for i in range(len(ids)) if find_loop(ids[:i], ids[i], settings, filler)]
        guarded = tiny_llm.generate({"prompt_token_ids": out.prompt_token_ids}, SamplingParams(
            temperature=1.0, seed=3, max_tokens=48), use_tqdm=False)[0].outputs[0]
        expected = ids[:trips[0] + 1] if trips else ids
        assert guarded.token_ids == expected
        assert guarded.finish_reason == ("repetition" if trips else out.outputs[0].finish_reason)
