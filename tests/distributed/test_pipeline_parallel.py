"""Pipeline parallelism over 2 real stage processes (gloo point-to-point) against one process, fp32.

Engines are built once per module where several tests share one (a stage process takes
seconds to start): a tiny Llama (tied embeddings: both stages hold the table) drafting n-gram
lookups (the last test kills its first stage, so it runs last), and a 3-layer Qwen2 in int8
(untied LM head, q/k/v biases; 2 + 1 layers: an uneven split) on a KV budget small enough to
preempt. The mixture-of-experts families run the same layer code through a stage.
"""

from __future__ import annotations

import signal
import threading
import time

import pytest
import torch

from kiln import LLM, SamplingParams
from kiln.config import ParallelConfig
from kiln.distributed.communicator import RankFailure
from kiln.engine.contract import ScheduledRequest, SchedulerOutput
from kiln.models.layers.pipeline import split_layers
from kiln.models.llama import LlamaArch
from kiln.runner.batch import build_batch
from kiln.runner.pipeline import head_cost, micro_batches
from tests.distributed.test_tensor_parallel import PROMPTS, SETTINGS, assert_same
from tests.parity.test_moe_parity import make_tiny_moe

CPU = torch.device("cpu")
GREEDY = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, prompt_logprobs=0)
TIMEOUT_S = 20


def pipeline_engine(path: str, **settings) -> LLM:
    return LLM(path, **{**SETTINGS, **settings}, pipeline_parallel_size=2,
               dist_timeout_s=TIMEOUT_S)


@pytest.fixture(scope="module")
def llama_pair(tiny_ckpt):
    path = tiny_ckpt("llama")
    # the staged engine drafts n-gram lookups (greedy output is unchanged by speculation):
    # verify steps of several tokens per sequence cross the stages too
    # and cuts each step into 3 micro-batches (a prefill chunk's parts on each stage in turn)
    one, two = LLM(path, **SETTINGS), pipeline_engine(path, speculator="ngram",
                                                      pipeline_micro_batches=3)
    yield one, two
    two.close()


@pytest.fixture(scope="module")
def qwen2_small(tiny_ckpt):
    """(one process, 2 stages on 8 KV blocks of the 2-layer stage): preemption and n > 1."""
    path = tiny_ckpt("qwen2", num_hidden_layers=3)
    one = LLM(path, **SETTINGS, quantization="int8")  # quantized on load, layer by layer
    block = one.engine.runner.kv_spec.bytes_per_block * 2 // 3  # the 2-layer stage's
    two = pipeline_engine(path, kv_cache_memory=8 * block, quantization="int8")
    yield one, two
    two.close()


def test_llama_pp2_matches_one_process(llama_pair, monkeypatch):
    one, two = llama_pair
    # each stage holds KV for one of the two layers: twice the blocks in the same bytes
    assert two.engine.limits.num_kv_blocks == 2 * one.engine.limits.num_kv_blocks
    runner, in_flight = two.engine.runner, []
    submit = runner.submit

    def counting_submit(sched, **kwargs):  # how many steps are in flight as each is submitted
        in_flight.append(len(two.engine.pipeline.in_flight))
        submit(sched, **kwargs)

    monkeypatch.setattr(runner, "submit", counting_submit)
    assert_same(one.generate(PROMPTS, GREEDY, use_tqdm=False),
                two.generate(PROMPTS, GREEDY, use_tqdm=False))
    assert max(in_flight) == 1  # a step went down the stages while another was in them


def test_llama_pp2_prefix_cache_hit(llama_pair):
    one, two = llama_pair
    shared = list(range(10, 50)) + [60, 61]  # the 40-token prompt's blocks are cached
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    reference = one.generate([shared], params, use_tqdm=False)
    staged = two.generate([shared], params, use_tqdm=False)
    assert staged[0].num_cached_tokens == reference[0].num_cached_tokens == 32
    assert staged[0].outputs[0].token_ids == reference[0].outputs[0].token_ids


def test_ngram_speculation_across_stages(llama_pair):
    one, two = llama_pair
    repetitive = [[7, 8, 9, 10] * 6]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    out = two.generate(repetitive, params, use_tqdm=False)
    assert out[0].metrics["num_draft_tokens"] > 0
    assert out[0].outputs[0].token_ids == one.generate(
        repetitive, params, use_tqdm=False)[0].outputs[0].token_ids


def test_uneven_stages_preempt_and_match(qwen2_small):
    one, two = qwen2_small
    assert two.engine.limits.num_kv_blocks == 8
    prompts = [list(range(3 + i, 40 + i)) for i in range(4)]  # ~5 blocks each at the end
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    reference = one.generate(prompts, params, use_tqdm=False)
    staged = two.generate(prompts, params, use_tqdm=False)
    assert two.engine.scheduler.num_preemptions > 0
    for ref, out in zip(reference, staged, strict=True):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids


def test_n_greater_than_one_with_a_seed(qwen2_small):
    one, two = qwen2_small
    params = SamplingParams(n=3, max_tokens=16, temperature=1.0, seed=7, ignore_eos=True)
    reference = one.generate([[5, 6, 7, 8, 9]], params, use_tqdm=False)[0]
    staged = two.generate([[5, 6, 7, 8, 9]], params, use_tqdm=False)[0]
    assert [c.token_ids for c in staged.outputs] == [c.token_ids for c in reference.outputs]
    assert len({tuple(c.token_ids) for c in staged.outputs}) > 1  # really sampled


@pytest.mark.parametrize("model_type", ["qwen2_moe", "mixtral"])
def test_moe_families_pp2_match_one_process(tmp_path, model_type):
    path = make_tiny_moe(tmp_path, model_type)  # qwen2_moe: a sparse then a dense layer
    one, two = LLM(path, **SETTINGS), pipeline_engine(path)
    try:
        assert_same(one.generate(PROMPTS, GREEDY, use_tqdm=False),
                    two.generate(PROMPTS, GREEDY, use_tqdm=False))
    finally:
        two.close()


def test_more_stages_than_layers_fail_with_the_numbers(tiny_ckpt):
    with pytest.raises(ValueError, match="pipeline_parallel_size 3 exceeds the model's 2 "
                                         "decoder layers"):
        LLM(tiny_ckpt("llama"), **SETTINGS, pipeline_parallel_size=3)


@pytest.mark.slow
def test_tensor_parallel_stages_match_one_process(tiny_ckpt, monkeypatch):
    """TP=2 x PP=2: 4 ranks on 2 cores (`make test-all`), two steps in flight as at PP=2
    (the last stage's second rank runs each step when rank 0 does)."""
    path = tiny_ckpt("llama")
    one = LLM(path, **SETTINGS)
    four = pipeline_engine(path, tensor_parallel_size=2, pipeline_micro_batches=2)
    runner, in_flight = four.engine.runner, []
    submit = runner.submit

    def counting_submit(sched, **kwargs):
        in_flight.append(len(four.engine.pipeline.in_flight))
        submit(sched, **kwargs)

    monkeypatch.setattr(runner, "submit", counting_submit)
    try:
        # half the KV heads and half the layers per rank: four times the blocks
        assert four.engine.limits.num_kv_blocks == 4 * one.engine.limits.num_kv_blocks
        assert_same(one.generate(PROMPTS, GREEDY, use_tqdm=False),
                    four.generate(PROMPTS, GREEDY, use_tqdm=False))
        assert max(in_flight) == 1  # a step went down the stages while another was in them
        # a lone prompt: each step is finished with a FinishStep (nothing else to submit)
        assert_same(one.generate(PROMPTS[:1], GREEDY, use_tqdm=False),
                    four.generate(PROMPTS[:1], GREEDY, use_tqdm=False))
    finally:
        four.close()


def test_micro_batches_must_be_positive():
    with pytest.raises(ValueError, match="pipeline_micro_batches must be >= 1, got 0"):
        ParallelConfig(pipeline_parallel_size=2, pipeline_micro_batches=0)


def test_speculation_from_a_model_is_refused(tiny_ckpt):
    with pytest.raises(ValueError, match="speculative method 'draft' with "
                                         "pipeline_parallel_size 2: only ngram"):
        LLM(tiny_ckpt("llama"), **SETTINGS, pipeline_parallel_size=2,
            speculator=tiny_ckpt("llama"))


@pytest.mark.parametrize(("layers", "count", "head", "sizes"), [
    (22, 2, 0.0, [11, 11]),
    (5, 2, 0.0, [3, 2]),  # the first stage takes the odd layer
    (30, 2, 8.0, [19, 11]),  # the LM head is worth 8 layers: the last stage takes fewer
    (10, 3, 2.0, [4, 4, 2]),
    (2, 2, 9.0, [1, 1]),  # every stage keeps one layer
    (4, 1, 3.0, [4]),
])
def test_layers_split_into_stages_of_equal_work(layers, count, head, sizes):
    stages = split_layers(layers, count, head)
    assert [len(s) for s in stages] == sizes
    assert [i for s in stages for i in s] == list(range(layers))  # contiguous, in order


def test_head_cost_counts_the_head_in_layers():
    # SmolLM2-135M's shape: a 49K-vocabulary head does ~8 layers' multiply-adds per token
    smol = LlamaArch(576, 1536, 30, 9, 3, 64, 49152, 1e-5, 1e5, None, 8192, True, False, False)
    assert 7.5 < head_cost(smol) < 8.5


def _step(*lengths: int) -> SchedulerOutput:
    """Sequences of `lengths` new tokens after 3 cached ones, token i being 100 * seq + i."""
    items = [ScheduledRequest(str(s), [100 * s + i for i in range(n)], 3, 0, [0, 1, 2, 3], True,
                              SamplingParams(), [], [], False)
             for s, n in enumerate(lengths)]
    return SchedulerOutput(items, sum(lengths))


@pytest.mark.parametrize(("lengths", "count", "tokens"), [
    ((1,) * 8, 4, [2, 2, 2, 2]),  # decodes: equal groups
    ((16, 1, 1, 1), 2, [9, 10]),  # a prefill chunk cut in two
    ((1, 1), 4, [1, 1]),  # none empty
    ((40,), 4, [10, 10, 10, 10]),  # one long prompt's chunk: a pipeline of its own
])
def test_micro_batches_split_the_flat_batch_by_tokens(lengths, count, tokens):
    step = _step(*lengths)
    parts = micro_batches(step, count)
    assert [p.num_batched_tokens for p in parts] == tokens
    whole, cut = build_batch(step, CPU), [build_batch(p, CPU) for p in parts]
    assert torch.equal(torch.cat([b.input_ids for b in cut]), whole.input_ids)
    assert torch.equal(torch.cat([b.positions for b in cut]), whole.positions)
    assert [s.samples for p in parts for s in p.scheduled][-1]  # the last part samples


def test_a_query_with_drafts_stays_whole():
    step = _step(1, 5, 1)
    step.scheduled[1].num_draft_tokens = 4  # a tree's attention bits span its whole query
    assert [p.num_batched_tokens for p in micro_batches(step, 2)] == [6, 1]


def test_a_killed_stage_fails_the_engine_fast(llama_pair):
    _, two = llama_pair
    first_stage = two.engine.runner.leader.processes[0]
    long = SamplingParams(max_tokens=900, temperature=0, ignore_eos=True)
    killed_at: list[float] = []

    def kill() -> None:
        killed_at.append(time.monotonic())
        first_stage.send_signal(signal.SIGKILL)

    # eight long requests: still running when the stage dies, however fast the machine
    threading.Timer(0.3, kill).start()
    with pytest.raises(RankFailure, match="a rank died"):
        two.generate([[5, 6, 7 + i] for i in range(8)], long, use_tqdm=False)
    assert killed_at and time.monotonic() - killed_at[0] < TIMEOUT_S + 10
    assert first_stage.poll() is not None
    with pytest.raises(RankFailure):  # and stays failed, without hanging
        two.generate([[5, 6, 7]], GREEDY, use_tqdm=False)
