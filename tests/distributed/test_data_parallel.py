"""Data-parallel attention beside expert parallelism over 2 real rank processes, fp32.

`data_parallel_size=2, enable_expert_parallel=True`: each rank runs attention whole on its own
requests (its own KV pool), the experts are split between the ranks and the tokens exchanged
around every sparse block. A batch of prompts of different lengths and lengths of output
(more than one rank gets, and steps where one rank has nothing to run) must give one
process's greedy tokens and prompt logprobs, for Qwen3-MoE (GQA) and DeepSeek-V3 (MLA, a
dense first layer, shared experts); each rank's KV pool holds only its own requests' blocks.
"""

from __future__ import annotations

import math

import pytest
import torch

from kiln import LLM, SamplingParams
from kiln.config import ParallelConfig
from kiln.engine.core import EngineRequest
from kiln.runner.data_parallel import DataParallelAttention, split_by_rank
from tests.distributed.test_tensor_parallel import SETTINGS, assert_same
from tests.parity.test_mla_parity import make_tiny_deepseek
from tests.parity.test_moe_parity import make_tiny_moe

# 16, 40, 4, 20 and 3 tokens in 16-token steps: the first step prefills the first prompt
# alone (rank 1 has nothing to run), and the requests placed on rank 1 (the second and
# fourth: the fewest requests, then the most free blocks) decode longest (rank 0 idle)
PROMPTS = [list(range(20, 36)), list(range(10, 50)), [100, 3, 77, 4], list(range(60, 80)),
           [9, 8, 7]]
PARAMS = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, prompt_logprobs=0)
          for n in (6, 28, 4, 20, 3)]
DP = dict(data_parallel_size=2, enable_expert_parallel=True, dist_timeout_s=20)


def deepseek_sparse(path) -> str:
    """DeepSeek-V3 with MLA, layer 0 dense, layer 1 8 experts in 4 groups and a shared one."""
    return make_tiny_deepseek(path, "yarn", first_k_dense_replace=1, n_routed_experts=8,
                              num_experts_per_tok=2, n_group=4, topk_group=2,
                              moe_intermediate_size=16, n_shared_experts=1,
                              routed_scaling_factor=2.5, norm_topk_prob=True)


MAKERS = {"qwen3_moe": lambda path: make_tiny_moe(path, "qwen3_moe"),
          "deepseek_v3": deepseek_sparse}


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """family -> (one-process engine, data-parallel engine); closed at the end."""
    made: dict[str, tuple[LLM, LLM]] = {}

    def get(family: str) -> tuple[LLM, LLM]:
        if family not in made:
            path = MAKERS[family](tmp_path_factory.mktemp(family))
            made[family] = LLM(path, **SETTINGS), LLM(path, **SETTINGS, **DP)
        return made[family]

    yield get
    for _, two in made.values():
        two.close()


def record_rank_occupancy(llm: LLM) -> list[tuple[int, ...]]:
    """Sequences per rank of each step the engine runs from now on (observed, not changed)."""
    runner, seen = llm.engine.runner, []
    lead = runner.data_parallel.lead

    def observed(sched, leader):
        seen.append(tuple(len(p.scheduled) for p in split_by_rank(sched, 2)))
        return lead(sched, leader)

    runner.data_parallel.lead = observed
    return seen


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_two_data_parallel_ranks_match_one_process(engines, family):
    one, two = engines(family)
    assert isinstance(two.engine.runner.data_parallel, DataParallelAttention)
    occupancy = record_rank_occupancy(two)
    outputs = two.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert_same(one.generate(PROMPTS, PARAMS, use_tqdm=False), outputs)
    assert any(a and b for a, b in occupancy)  # both ranks ran requests in one step
    assert any(a == 0 < b for a, b in occupancy)  # rank 0 (the engine's) idle in a step
    assert any(b == 0 < a for a, b in occupancy)  # rank 1 idle in a step
    # every rank routes every token of the step: the one process's counts
    load = two.expert_load()
    assert load.tokens.tolist() == one.expert_load().tokens.tolist()
    assert load.rank_tokens.sum(dim=1).tolist() == load.tokens.sum(dim=1).tolist()


def test_each_rank_holds_only_its_own_requests_kv(engines):
    """Mid-run, every request's blocks are in one rank's pool only; rank 0's cache tensors
    hold written KV in exactly its own requests' blocks (the other rank's are untouched),
    and each rank's pool is as large as one process's: the KV is not duplicated."""
    one, two = engines("qwen3_moe")
    engine, runner = two.engine, two.engine.runner
    assert engine.limits.num_kv_blocks == one.engine.limits.num_kv_blocks  # heads not split
    assert engine.kv.stats().num_blocks == 2 * one.engine.limits.num_kv_blocks
    engine.kv.set_prefix_caching(True)  # drop cached blocks: nothing reused below
    bs = runner.kv_spec.block_size
    for layer in runner.kv_caches:
        for cache in layer:
            cache[bs:].fill_(math.nan)  # block 0 stays zero (padded lanes read it)
    prompts = {f"r{i}": p for i, p in enumerate(PROMPTS)}
    for rid, prompt in prompts.items():
        engine.add_request(EngineRequest(request_id=rid, prompt_token_ids=prompt,
                                         params=SamplingParams(max_tokens=8, ignore_eos=True)))
    for _ in range(6):  # every prompt prefilled (16-token steps), none finished
        engine.step()
    kv = engine.kv
    ranks = {rid: kv.dp_rank(rid) for rid in prompts}
    assert set(ranks.values()) == {0, 1}
    for rid, rank in ranks.items():
        own, other = kv.pools[rank].block_ids(rid), kv.pools[1 - rank].block_ids(rid)
        assert len(own) == -(-(len(prompts[rid]) + 1) // bs) and other == []
    for rank in (0, 1):
        held = sum(len(kv.pools[rank].block_ids(r)) for r in prompts if ranks[r] == rank)
        assert kv.pools[rank].stats().used_blocks == held
    rank0_blocks = {b for r in prompts if ranks[r] == 0 for b in kv.pools[0].block_ids(r)}
    key = runner.kv_caches[0][0].view(-1, bs, *runner.kv_caches[0][0].shape[1:])
    written = {b for b in range(1, key.shape[0]) if not torch.isnan(key[b]).all()}
    assert written == rank0_blocks - {0}
    while engine.has_unfinished():
        engine.step()


def test_bad_combinations_fail_at_start_naming_the_numbers(tiny_ckpt, tmp_path):
    with pytest.raises(ValueError, match="data_parallel_size 2 needs a mixture-of-experts "
                                         "model"):
        LLM(tiny_ckpt("llama"), **SETTINGS, **DP)
    with pytest.raises(ValueError, match="data_parallel_size 2 with tensor_parallel_size 2"):
        ParallelConfig(data_parallel_size=2, tensor_parallel_size=2)
    path = make_tiny_moe(tmp_path, "qwen3_moe", num_experts=6)
    with pytest.raises(ValueError, match="6 experts \\+ 1 redundant copies = 7 expert slots, "
                                         "not divisible by data_parallel_size 2"):
        LLM(path, **SETTINGS, **DP, num_redundant_experts=1)
    with pytest.raises(ValueError, match="data_parallel_size 2 with speculative decoding"):
        LLM(path, **SETTINGS, **DP, speculator="ngram")


def test_a_data_parallel_server_answers_as_one_process(engines, tmp_path):
    """`kiln serve --data-parallel-size 2 --enable-expert-parallel`: two concurrent
    completions (one per rank) give one process's greedy text, and /metrics counts every
    routed pair of both, per expert and per rank."""
    from concurrent.futures import ThreadPoolExecutor

    from tests.cluster.conftest import wait_for
    from tests.serve.conftest import start_server

    one, _ = engines("qwen3_moe")
    prompts = ["The quick brown fox", "Paris is the capital of"]
    expected = [o.outputs[0].text for o in one.generate(
        prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), use_tqdm=False)]
    server = start_server(one.engine.model_path, tmp_path, "--data-parallel-size", "2",
                          "--enable-expert-parallel", "--served-model-name", "m", wait=False)
    try:
        server.wait_health(200, timeout=180)  # three processes start on shared cores
        client = server.openai()

        def complete(prompt: str):
            return client.completions.create(model="m", prompt=prompt, max_tokens=6,
                                             temperature=0, extra_body={"ignore_eos": True})

        with ThreadPoolExecutor(2) as pool:
            outs = list(pool.map(complete, prompts))
        assert [o.choices[0].text for o in outs] == expected
        computed = sum(o.usage.prompt_tokens + o.usage.completion_tokens - 1 for o in outs)

        def routed(kind: str) -> list[float]:
            return [v for k, v in server.metrics().items() if k.startswith(
                f"kiln:moe_{kind}_tokens_total{{") and 'layer="0"' in k]

        wait_for(lambda: sum(routed("expert")) == 2 * computed, 30, server,
                 "both completions' routed pairs (top 2) in /metrics")
        assert len(routed("rank")) == 2 and sum(routed("rank")) == 2 * computed
    finally:
        server.stop()
