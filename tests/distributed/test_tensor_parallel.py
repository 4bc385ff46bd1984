"""Tensor parallelism over 2 real rank processes (gloo) against one process, fp32.

Each engine pair is built once per module (a rank process takes seconds to start): a tiny
Llama (KV heads split over the ranks, tied embeddings) and a tiny Qwen2 with one KV head
(replicated on both ranks; q/k/v biases; an untied LM head) in int8. The last test kills a rank of
the Qwen2 engine, so it runs last.
"""

from __future__ import annotations

import signal
import threading
import time

import pytest

from kiln import LLM, SamplingParams
from kiln.distributed.communicator import RankFailure

PROMPTS = [[5, 6, 7, 8, 9], list(range(10, 50)), [100, 3, 77, 4]]  # 5, 40 and 4 tokens
GREEDY = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, prompt_logprobs=0)
# 16-token steps: the 40-token prompt prefills in chunks, beside the others' decodes
SETTINGS = dict(dtype="float32", kv_cache_memory=4 << 20, max_num_batched_tokens=16,
                num_threads=1)


# a shared-memory all-reduce sees a dead rank only when its wait times out: keep that short
TIMEOUT_S = 20


def engine_pair(path: str, quantization: str | None = None,
                **tp_settings) -> tuple[LLM, LLM]:
    both = dict(SETTINGS, quantization=quantization)
    return LLM(path, **both), LLM(path, **both, tensor_parallel_size=2,
                                  dist_timeout_s=TIMEOUT_S, **tp_settings)


@pytest.fixture(scope="module")
def llama_pair(tiny_ckpt):
    # the sharded engine drafts n-gram lookups (greedy output is unchanged by speculation):
    # verify steps of several tokens per sequence cross the ranks too
    one, two = engine_pair(tiny_ckpt("llama"), speculator="ngram")
    yield one, two
    two.close()


@pytest.fixture(scope="module")
def qwen2_pair(tiny_ckpt):
    # int8 weights, quantized on load: codes and per-row scales shard with their rows
    # (column-parallel) or keep each row's scale whole (row-parallel)
    one, two = engine_pair(tiny_ckpt("qwen2", num_key_value_heads=1), quantization="int8")
    yield one, two
    two.close()


def prompt_logprobs(out) -> list[float]:
    return [pos[tid].logprob for pos, tid in zip(out.prompt_logprobs[1:],
                                                 out.prompt_token_ids[1:], strict=True)]


def assert_same(reference, sharded) -> None:
    for ref, tp in zip(reference, sharded, strict=True):
        assert tp.outputs[0].token_ids == ref.outputs[0].token_ids
        diffs = [abs(a - b) for a, b in zip(prompt_logprobs(ref), prompt_logprobs(tp),
                                            strict=True)]
        assert max(diffs) < 1e-4


def test_llama_tp2_matches_one_process(llama_pair):
    one, two = llama_pair
    assert two.engine.limits.num_kv_blocks == 2 * one.engine.limits.num_kv_blocks  # half the heads
    assert_same(one.generate(PROMPTS, GREEDY, use_tqdm=False),
                two.generate(PROMPTS, GREEDY, use_tqdm=False))


def test_llama_tp2_prefix_cache_hit(llama_pair):
    one, two = llama_pair
    shared = list(range(10, 50)) + [60, 61]  # the 40-token prompt's blocks are cached
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)  # (no prompt
    reference = one.generate([shared], params, use_tqdm=False)  # logprobs: those skip the cache)
    sharded = two.generate([shared], params, use_tqdm=False)
    assert sharded[0].num_cached_tokens == reference[0].num_cached_tokens == 32
    assert sharded[0].outputs[0].token_ids == reference[0].outputs[0].token_ids


def test_ngram_speculation_across_ranks(llama_pair):
    one, two = llama_pair
    repetitive = [[7, 8, 9, 10] * 6]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    out = two.generate(repetitive, params, use_tqdm=False)
    assert out[0].metrics["num_draft_tokens"] > 0
    assert out[0].outputs[0].token_ids == one.generate(
        repetitive, params, use_tqdm=False)[0].outputs[0].token_ids


def test_qwen2_int8_replicated_kv_head_matches_one_process(qwen2_pair):
    one, two = qwen2_pair
    assert_same(one.generate(PROMPTS, GREEDY, use_tqdm=False),
                two.generate(PROMPTS, GREEDY, use_tqdm=False))


def test_qwen3_qk_norm_matches_one_process(tiny_ckpt):
    one, two = engine_pair(tiny_ckpt("qwen3"))  # q/k RMSNorm per head; head_dim 32 != 64 / 4
    try:
        assert_same(one.generate(PROMPTS, GREEDY, use_tqdm=False),
                    two.generate(PROMPTS, GREEDY, use_tqdm=False))
    finally:
        two.close()


def test_heads_not_divisible_fail_with_the_numbers(tiny_ckpt):
    with pytest.raises(ValueError, match="tensor_parallel_size 3 does not divide the model's "
                                         "4 attention heads"):
        LLM(tiny_ckpt("llama"), **SETTINGS, tensor_parallel_size=3)


def test_a_killed_rank_fails_the_engine_fast(qwen2_pair):
    _, two = qwen2_pair
    follower = two.engine.runner.leader.processes[0]
    long = SamplingParams(max_tokens=900, temperature=0, ignore_eos=True)
    killed_at: list[float] = []

    def kill() -> None:
        killed_at.append(time.monotonic())
        follower.send_signal(signal.SIGKILL)

    # eight long requests: still running when the rank dies, however fast the machine
    threading.Timer(0.3, kill).start()
    with pytest.raises(RankFailure, match="a rank died"):
        two.generate([[5, 6, 7 + i] for i in range(8)], long, use_tqdm=False)
    assert killed_at and time.monotonic() - killed_at[0] < TIMEOUT_S + 10
    assert follower.poll() is not None
    with pytest.raises(RankFailure):  # and stays failed, without hanging
        two.generate([[5, 6, 7]], GREEDY, use_tqdm=False)
