"""Engine features over 2 real rank processes (gloo) against one process, fp32, tiny Llama:
preemption, n > 1, structured output, a draft model and an EAGLE-style head
(test_tensor_parallel covers chunked prefill, prefix cache hits and n-gram speculation).

Both engines get 8 KV blocks (the sharded one half the bytes: each rank holds half the KV
heads), so four requests of ~4 blocks each cannot run together and some are preempted.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from kiln import LLM, SamplingParams
from kiln.sampling_params import RepetitionGuardParams, StructuredOutputsParams

PROMPTS = [list(range(10, 40)), [5, 6, 7, 8, 9] * 5, list(range(200, 228)), [100, 3, 77] * 9]
SETTINGS = dict(dtype="float32", num_threads=1, max_num_batched_tokens=16)
BLOCKS = 8


@pytest.fixture(scope="module")
def small_pool_pair(tiny_ckpt):
    path = tiny_ckpt("llama")
    probe = LLM(path, **SETTINGS)
    block_bytes = probe.engine.runner.kv_spec.bytes_per_block  # one process: all KV heads
    del probe
    one = LLM(path, **SETTINGS, kv_cache_memory=BLOCKS * block_bytes)
    two = LLM(path, **SETTINGS, kv_cache_memory=BLOCKS * block_bytes // 2,
              tensor_parallel_size=2)
    assert one.engine.limits.num_kv_blocks == two.engine.limits.num_kv_blocks == BLOCKS
    yield one, two
    two.close()


def prompt_logprobs(out) -> list[float]:
    return [pos[tid].logprob for pos, tid in zip(out.prompt_logprobs[1:],
                                                 out.prompt_token_ids[1:], strict=True)]


def assert_same(reference, sharded) -> None:
    for ref, tp in zip(reference, sharded, strict=True):
        assert [o.token_ids for o in tp.outputs] == [o.token_ids for o in ref.outputs]
        if ref.prompt_logprobs is not None:
            diffs = [abs(a - b) for a, b in zip(prompt_logprobs(ref), prompt_logprobs(tp),
                                                strict=True)]
            assert max(diffs) < 1e-4


def both(pair, prompts, params):
    return [llm.generate(prompts, params, use_tqdm=False) for llm in pair]


def test_preemption_gives_the_same_tokens(small_pool_pair):
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, prompt_logprobs=0)
    before = [llm.engine.scheduler.num_preemptions for llm in small_pool_pair]
    assert_same(*both(small_pool_pair, PROMPTS, params))
    after = [llm.engine.scheduler.num_preemptions for llm in small_pool_pair]
    assert after[0] > before[0] and after[1] > before[1]


def test_n_samples_give_the_same_tokens(small_pool_pair):
    # seeded sampling at temperature 0.8 over logits that agree to ~1e-6: the same draws
    params = SamplingParams(n=3, temperature=0.8, seed=11, max_tokens=16, ignore_eos=True,
                            prompt_logprobs=0)
    reference, sharded = both(small_pool_pair, PROMPTS[:2], params)
    assert len({tuple(o.token_ids) for o in reference[0].outputs}) > 1  # the samples differ
    assert_same(reference, sharded)


def test_json_schema_output_gives_the_same_tokens(small_pool_pair):
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0,
                                                     "maximum": 99},
                                               "b": {"enum": ["x", "y", "z"]}},
              "required": ["a", "b"], "additionalProperties": False}
    params = SamplingParams(max_tokens=48, temperature=0,
                            structured_outputs=StructuredOutputsParams(json=schema),
                            repetition_guard=RepetitionGuardParams(mode="off"))
    reference, sharded = both(small_pool_pair, ["The quick brown fox", "Paris is"], params)
    assert_same(reference, sharded)
    for out in sharded:
        assert out.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.outputs[0].text), schema)


def test_a_draft_model_gives_the_same_tokens(tiny_ckpt, small_pool_pair):
    """The draft (the target's own checkpoint, whole: its drafts are mostly accepted) runs in
    rank 0's process; greedy output is the target's alone, so the one-process engine without
    drafts is the reference."""
    one, _ = small_pool_pair
    spec = {"method": "draft_model", "model": tiny_ckpt("llama"), "adaptive": False}
    two = LLM(tiny_ckpt("llama"), **SETTINGS, tensor_parallel_size=2, speculative_config=spec)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, prompt_logprobs=0)
    try:
        sharded = two.generate(PROMPTS[:2], params, use_tqdm=False)
    finally:
        two.close()
    assert_same(one.generate(PROMPTS[:2], params, use_tqdm=False), sharded)
    drafted = sum(out.metrics["num_draft_tokens"] for out in sharded)
    accepted = sum(out.metrics["num_accepted_tokens"] for out in sharded)
    assert drafted >= accepted > 0


def test_an_eagle_head_drafts_as_in_one_process(tiny_ckpt, small_pool_pair, tmp_path):
    """An untrained head (random drafts, some accepted on a repetitive prompt): the sharded
    engine's head reads the same features and vocabulary rows, so it drafts and accepts as
    the one-process engine's does, and greedy output is the target's."""
    import torch

    from kiln.models.loader import read_hf_config
    from kiln.models.registry import resolve_architecture
    from kiln.speculative.head.model import EagleHead, HeadConfig, save_head

    path = tiny_ckpt("llama")
    _, arch = resolve_architecture(read_hf_config(path))
    torch.manual_seed(0)
    save_head(EagleHead(HeadConfig.for_target(arch, 256, (0, -1))), tmp_path, torch.float32)
    plain, _ = small_pool_pair
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, prompt_logprobs=0)
    # not adaptive: how much to draft would follow measured step times
    spec = {"method": "eagle", "model": str(tmp_path), "adaptive": False}
    one = LLM(path, **SETTINGS, speculative_config=spec)
    two = LLM(path, **SETTINGS, tensor_parallel_size=2, speculative_config=spec)
    try:
        sharded = two.generate(PROMPTS[:2], params, use_tqdm=False)
    finally:
        two.close()
    assert_same(plain.generate(PROMPTS[:2], params, use_tqdm=False), sharded)
    counts = [[(out.metrics["num_draft_tokens"], out.metrics["num_accepted_tokens"])
               for out in outs] for outs in (one.generate(PROMPTS[:2], params, use_tqdm=False),
                                             sharded)]
    assert counts[0] == counts[1] and sum(accepted for _, accepted in counts[1]) > 0
