"""Engine behaviour on a tiny model: caching, preemption, chunking, sampling, stops, n > 1."""

from __future__ import annotations

import pytest

from kiln import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def prompts_sharing_prefix(tok, n: int = 4) -> list[dict]:
    system = "The quick brown fox jumps over the lazy dog. " * 4  # several full blocks
    questions = ["Paris is", "def add(a, b):", "0123456789", "Large language models"]
    return [{"prompt_token_ids": tok.encode(system + q)} for q in questions[:n]]


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def reference(llama_path):
    """Greedy outputs of an unconstrained engine (no prefix caching, big budget)."""
    llm = LLM(llama_path, dtype="float32", enable_prefix_caching=False, num_threads=1)
    prompts = prompts_sharing_prefix(llm.get_tokenizer())
    return prompts, token_ids(llm.generate(prompts, GREEDY))


def test_prefix_caching_reuses_blocks_and_keeps_outputs(llama_path, reference):
    prompts, expected = reference
    llm = LLM(llama_path, dtype="float32", num_threads=1)
    first = llm.generate(prompts[:1], GREEDY)
    rest = llm.generate(prompts[1:], GREEDY)
    assert token_ids(first + rest) == expected
    assert first[0].num_cached_tokens == 0
    # the shared system prompt spans several full 16-token blocks
    assert all(o.num_cached_tokens >= 32 for o in rest)
    assert all(o.num_cached_tokens % 16 == 0 for o in rest)
    stats = llm.engine.kv.stats()
    assert stats.hit_tokens > 0 and stats.used_blocks == 0


def test_preemption_under_tiny_kv_budget_gives_same_tokens(llama_path, reference):
    prompts, expected = reference
    llm = LLM(llama_path, dtype="float32", num_threads=1, enable_prefix_caching=False)
    # 8 blocks of 16 tokens: each request needs about 4, so four cannot run together
    spec = llm.engine.runner.kv_spec
    small = LLM(llama_path, dtype="float32", num_threads=1, enable_prefix_caching=False,
                kv_cache_memory=8 * spec.bytes_per_block)
    del llm
    assert token_ids(small.generate(prompts, GREEDY)) == expected
    assert small.engine.scheduler.num_preemptions > 0
    assert small.engine.kv.stats().used_blocks == 0


def test_chunked_prefill_with_tiny_chunks_gives_same_tokens(llama_path, reference):
    prompts, expected = reference
    llm = LLM(llama_path, dtype="float32", num_threads=1, max_num_batched_tokens=5)
    assert token_ids(llm.generate(prompts, GREEDY)) == expected


def test_seeded_sampling_reproducible_alone_and_in_a_batch(tiny_llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16,
                            ignore_eos=True)
    alone = tiny_llm.generate(["The quick"], params)[0].outputs[0].token_ids
    again = tiny_llm.generate(["The quick"], params)[0].outputs[0].token_ids
    crowd = tiny_llm.generate(
        ["Paris is", "The quick", "def add"],
        [SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True), params,
         SamplingParams(temperature=0.7, seed=7, max_tokens=9, ignore_eos=True)])
    assert alone == again == crowd[1].outputs[0].token_ids
    other_seed = tiny_llm.generate(["The quick"], params.clone(seed=99))[0]
    assert other_seed.outputs[0].token_ids != alone


def test_stop_strings_cut_the_text(tiny_llm):
    base = tiny_llm.generate(["The quick brown"], GREEDY)[0].outputs[0]
    assert len(base.text) > 6
    stop = base.text[3:6]
    out = tiny_llm.generate(["The quick brown"], GREEDY.clone(stop=[stop]))[0].outputs[0]
    assert out.text == base.text[:base.text.index(stop)]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    kept = tiny_llm.generate(["The quick brown"],
                             GREEDY.clone(stop=[stop], include_stop_str_in_output=True))
    assert kept[0].outputs[0].text == base.text[:base.text.index(stop) + len(stop)]


def test_stop_token_ids_max_tokens_and_min_tokens(tiny_llm):
    base = tiny_llm.generate(["The quick brown"], GREEDY)[0].outputs[0]
    stop_token = base.token_ids[5]
    first = base.token_ids.index(stop_token)
    out = tiny_llm.generate(["The quick brown"], GREEDY.clone(stop_token_ids=[stop_token]))
    assert out[0].outputs[0].token_ids == base.token_ids[:first + 1]
    assert out[0].outputs[0].stop_reason == stop_token
    later = tiny_llm.generate(["The quick brown"], GREEDY.clone(
        stop_token_ids=[stop_token], min_tokens=first + 2))[0].outputs[0]
    assert len(later.token_ids) >= first + 2 and stop_token not in later.token_ids[:first + 2]
    short = tiny_llm.generate(["The quick brown"], GREEDY.clone(max_tokens=3))[0].outputs[0]
    assert short.token_ids == base.token_ids[:3] and short.finish_reason == "length"


def test_eos_ends_the_sequence_unless_ignored(tiny_llm):
    eos = next(iter(tiny_llm.engine.eos_token_ids))
    forced = SamplingParams(temperature=0, max_tokens=10, repetition_penalty=1.0)
    # a prompt whose greedy continuation holds EOS somewhere is model-dependent, so check
    # the rule directly: any EOS in the output must be the last token
    for prompt in ["The", "Paris", "0", "def", "{", "<|im_start|>assistant\n"]:
        out = tiny_llm.generate([prompt], forced)[0].outputs[0]
        if eos in out.token_ids:
            assert out.token_ids.index(eos) == len(out.token_ids) - 1
            assert out.finish_reason == "stop"
    ignored = tiny_llm.generate(["The"], GREEDY.clone(max_tokens=40))[0].outputs[0]
    assert len(ignored.token_ids) == 40


def test_n_greater_than_one_shares_the_prompt_blocks(llama_path):
    llm = LLM(llama_path, dtype="float32", num_threads=1)
    prompt = "The quick brown fox jumps over the lazy dog. " * 3
    params = SamplingParams(n=4, temperature=1.0, seed=5, max_tokens=8, ignore_eos=True)
    out = llm.generate([prompt], params)[0]
    assert [o.index for o in out.outputs] == [0, 1, 2, 3]
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    assert out.num_cached_tokens >= 16  # later children reuse the first child's blocks


def test_logprobs_and_prompt_logprobs_shapes(tiny_llm):
    params = SamplingParams(temperature=0, max_tokens=5, logprobs=3, prompt_logprobs=2,
                            ignore_eos=True)
    out = tiny_llm.generate(["The quick brown fox"], params)[0]
    assert out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == len(out.prompt_token_ids)
    for tok, entry in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:], strict=True):
        assert tok in entry and len(entry) in (2, 3)
    completion = out.outputs[0]
    assert len(completion.logprobs) == 5
    for tok, entry in zip(completion.token_ids, completion.logprobs, strict=True):
        assert entry[tok].rank == 1  # greedy picks the top token
    assert completion.cumulative_logprob == pytest.approx(
        sum(e[t].logprob for t, e in zip(completion.token_ids, completion.logprobs,
                                         strict=True)))


def test_repetition_penalty_matches_hf(llama_path):
    import torch
    from transformers import AutoModelForCausalLM

    llm = LLM(llama_path, dtype="float32", num_threads=1)
    ids = llm.get_tokenizer().encode("The quick brown fox")
    out = llm.generate([{"prompt_token_ids": ids}], GREEDY.clone(repetition_penalty=1.5))
    model = AutoModelForCausalLM.from_pretrained(llama_path, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    ref = model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False,
                         repetition_penalty=1.5, pad_token_id=0)[0, len(ids):].tolist()
    assert out[0].outputs[0].token_ids == ref


def test_priority_policy_admits_lower_value_first(llama_path):
    llm = LLM(llama_path, dtype="float32", num_threads=1, max_num_seqs=1,
              scheduling_policy="priority")
    order = []
    engine = llm.engine
    from kiln.engine.core import EngineRequest
    for rid, prio in [("low", 5), ("high", 0), ("mid", 2)]:
        engine.add_request(EngineRequest(request_id=rid, prompt_token_ids=[5, 6, 7],
                                         params=SamplingParams(max_tokens=2), priority=prio))
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                order.append(o.request_id)
    assert order == ["high", "mid", "low"]


def test_abort_frees_blocks(llama_path):
    from kiln.engine.core import EngineRequest

    llm = LLM(llama_path, dtype="float32", num_threads=1)
    engine = llm.engine
    engine.add_request(EngineRequest(request_id="x", prompt_token_ids=list(range(5, 60)),
                                     params=SamplingParams(max_tokens=100, ignore_eos=True)))
    engine.step()
    assert engine.kv.stats().used_blocks > 0
    engine.abort_requests(["x"])
    outs = engine.step()
    assert [o.finish_reason for o in outs] == ["abort"]
    assert engine.kv.stats().used_blocks == 0 and not engine.has_unfinished()
