"""Mixture-of-experts models over 2 real rank processes (gloo) against one process, fp32.

TP=2 splits every expert's columns; EP=2 (`enable_expert_parallel`) places whole experts on
the ranks; with `num_redundant_experts` the hottest experts (from a load file measured by the
one-process engine) get a copy on each rank and their tokens split between the copies. Each
must give one process's greedy tokens over a batch of prompts of different lengths (one is
prefilled in chunks beside the others' decodes), and count the same routed pairs.
"""

from __future__ import annotations

import pytest

from kiln import LLM, SamplingParams
from tests.distributed.test_tensor_parallel import PROMPTS, SETTINGS, assert_same
from tests.parity.test_moe_parity import make_tiny_moe

GREEDY = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, prompt_logprobs=0)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """family -> (checkpoint, one process's outputs and expert load after one run)."""
    made = {}

    def get(family: str):
        if family not in made:
            path = make_tiny_moe(tmp_path_factory.mktemp(family), family)
            one = LLM(path, **SETTINGS)
            made[family] = path, one.generate(PROMPTS, GREEDY, use_tqdm=False), \
                one.expert_load()
        return made[family]

    return get


def run_two_ranks(path: str, **settings):
    two = LLM(path, **SETTINGS, tensor_parallel_size=2, dist_timeout_s=20, **settings)
    try:
        return two.generate(PROMPTS, GREEDY, use_tqdm=False), two.expert_load()
    finally:
        two.close()


@pytest.mark.parametrize("family, expert_parallel", [
    ("qwen3_moe", False), ("qwen3_moe", True),
    ("mixtral", False), ("mixtral", True),
    ("glm4_moe", True),  # shared experts split by columns beside whole routed experts
    ("qwen2_moe", False),  # a gated shared expert; layer 1 a dense MLP
])
def test_two_ranks_match_one_process(reference, family, expert_parallel):
    path, expected, one_load = reference(family)
    outputs, load = run_two_ranks(path, enable_expert_parallel=expert_parallel)
    assert_same(expected, outputs)
    assert load.tokens.tolist() == one_load.tokens.tolist()  # the same routing, counted once
    if expert_parallel:  # each routed pair computed on exactly one rank
        assert load.rank_tokens.sum(dim=1).tolist() == load.tokens.sum(dim=1).tolist()
    else:
        assert load.rank_tokens is None


def test_redundant_copies_of_the_hottest_experts(reference, tmp_path):
    path, expected, one_load = reference("qwen3_moe")
    load_file = tmp_path / "load.json"
    one_load.save(load_file)
    two = LLM(path, **SETTINGS, tensor_parallel_size=2, dist_timeout_s=20,
              enable_expert_parallel=True, num_redundant_experts=2, expert_load_file=str(load_file))
    try:
        outputs = two.generate(PROMPTS, GREEDY, use_tqdm=False)
        blocks = [m for m in two.engine.runner.model.modules() if hasattr(m, "expert_tokens")]
        load = two.expert_load()
    finally:
        two.close()
    assert_same(expected, outputs)
    for block, tokens in zip(blocks, one_load.tokens.tolist(), strict=True):
        hottest = max(range(len(tokens)), key=lambda e: (tokens[e], -e))
        assert len(block.experts.shard.placement.ranks_of[hottest]) == 2  # on both ranks
        assert len(block.experts) == 5  # (8 experts + 2 copies) / 2 ranks
    assert load.tokens.tolist() == one_load.tokens.tolist()


@pytest.mark.parametrize("overrides, settings, message", [
    ({"num_experts": 6}, {"enable_expert_parallel": True, "num_redundant_experts": 1},
     "6 experts \\+ 1 redundant copies = 7 expert slots, not divisible by "
     "tensor_parallel_size 2"),
    ({}, {"enable_expert_parallel": True, "num_redundant_experts": 10},
     "num_redundant_experts 10 is more than the 8 copies 8 experts can have over 2 ranks"),
    ({"moe_intermediate_size": 33}, {},
     "tensor_parallel_size 2 does not divide the experts' intermediate size 33"),
])
def test_bad_splits_fail_at_start_naming_the_numbers(tmp_path, overrides, settings, message):
    path = make_tiny_moe(tmp_path, "qwen3_moe", **overrides)
    with pytest.raises(ValueError, match=message):
        LLM(path, **SETTINGS, tensor_parallel_size=2, **settings)


def test_expert_load_in_metrics_of_an_expert_parallel_server(reference, tmp_path):
    """`kiln serve --tensor-parallel-size 2 --enable-expert-parallel`: after one completion
    /metrics holds every routed pair (prompt tokens + the decode steps' tokens, times k = 2)
    per layer, per expert and per rank, with the imbalance figures."""
    from tests.cluster.conftest import wait_for
    from tests.serve.conftest import start_server

    path = reference("qwen3_moe")[0]
    server = start_server(path, tmp_path, "--tensor-parallel-size", "2",
                          "--enable-expert-parallel", "--served-model-name", "m", wait=False)
    try:
        server.wait_health(200, timeout=180)  # three processes start on shared cores
        out = server.openai().completions.create(model="m", prompt="The quick brown fox",
                                                 max_tokens=4, temperature=0)
        computed = out.usage.prompt_tokens + out.usage.completion_tokens - 1  # last not fed
        layers = ("0", "1")

        def routed(kind: str, layer: str) -> float:
            return sum(v for k, v in server.metrics().items() if k.startswith(
                f"kiln:moe_{kind}_tokens_total{{") and f'layer="{layer}"' in k)

        wait_for(lambda: all(routed("expert", layer) == 2 * computed for layer in layers), 30,
                 server, "the expert load of one completion in /metrics")
        metrics = server.metrics()
        assert all(routed("rank", layer) == 2 * computed for layer in layers)
        for layer in layers:
            assert metrics[f'kiln:moe_expert_imbalance{{layer="{layer}"}}'] >= 1.0
            assert 1.0 <= metrics[f'kiln:moe_rank_imbalance{{layer="{layer}"}}'] <= 2.0
    finally:
        server.stop()
