"""DeepSeek-V3's multi-head latent attention over 2 real rank processes (gloo) against one
process, fp32.

A rank holds half the heads (q_b_proj / q_proj and kv_b_proj rows, o_proj columns) and
computes the latent whole, so its cache holds the same latent blocks as one process's. Layer 0
is a dense MLP (split by columns), layer 1 DeepSeek's mixture of experts: experts split by
columns, or whole experts on ranks (`enable_expert_parallel`), the shared expert by columns.
Greedy tokens over prompts of different lengths (one prefilled in chunks beside the others'
decodes) and prompt logprobs must be one process's, and so must a continuation whose first
32 tokens' latent blocks come from the prefix cache.
"""

from __future__ import annotations

import pytest

from kiln import LLM, SamplingParams
from tests.distributed.test_tensor_parallel import GREEDY, PROMPTS, SETTINGS, assert_same
from tests.parity.test_mla_parity import make_tiny_deepseek

# after PROMPTS, the 40-token prompt's first two 16-token blocks are cached: a hit reuses
# each rank's copy of their latents
SHARED = PROMPTS[1] + [60, 61]
SHORT = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)  # no prompt logprobs:
# those would skip the cache

# layer 1 sparse: 8 experts, top 2 of 4 groups / 2, one shared expert
SPARSE = dict(first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
              topk_group=2, moe_intermediate_size=16, n_shared_experts=1,
              routed_scaling_factor=2.5, norm_topk_prob=True)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """variant -> (checkpoint, one process's outputs, its continuation of SHARED and its
    KV blocks)."""
    made = {}

    def get(variant: str):
        if variant not in made:
            path = make_tiny_deepseek(tmp_path_factory.mktemp(variant), variant, **SPARSE)
            one = LLM(path, **SETTINGS)
            made[variant] = (path, one.generate(PROMPTS, GREEDY, use_tqdm=False),
                             one.generate([SHARED], SHORT, use_tqdm=False)[0],
                             one.engine.limits.num_kv_blocks)
        return made[variant]

    return get


@pytest.mark.parametrize("variant, expert_parallel", [
    ("yarn", False),  # q LoRA (q_a_proj replicated, q_b_proj split), YaRN, interleaved rope
    ("yarn", True),
    ("plain", True),  # q_proj split; o_proj's bias added once, on rank 0
])
def test_two_ranks_match_one_process(reference, variant, expert_parallel):
    path, expected, expected_hit, one_blocks = reference(variant)
    two = LLM(path, **SETTINGS, tensor_parallel_size=2, dist_timeout_s=20,
              enable_expert_parallel=expert_parallel)
    try:
        outputs = two.generate(PROMPTS, GREEDY, use_tqdm=False)
        hit = two.generate([SHARED], SHORT, use_tqdm=False)[0]
        attention = two.engine.runner.model.model.layers[0].self_attn
        assert attention.num_heads == 2  # of 4
        # the latent is replicated: as many blocks fit as in one process
        assert two.engine.limits.num_kv_blocks == one_blocks
    finally:
        two.close()
    assert_same(expected, outputs)
    assert hit.num_cached_tokens == 32
    assert hit.outputs[0].token_ids == expected_hit.outputs[0].token_ids


def test_heads_not_divisible_fail_at_start_naming_the_numbers(tmp_path):
    path = make_tiny_deepseek(tmp_path, "plain", num_attention_heads=3, num_key_value_heads=3)
    with pytest.raises(ValueError, match="tensor_parallel_size 2 does not divide the model's "
                                         "3 attention heads"):
        LLM(path, **SETTINGS, tensor_parallel_size=2)
