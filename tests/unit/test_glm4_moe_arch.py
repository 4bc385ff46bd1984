"""GLM-4.5's config.json read into kiln's arch: partial rotary, dense layers, MTP, variants."""

from __future__ import annotations

import pytest
import torch

from kiln.models.glm4_moe import Glm4MoeArch, PartialRotaryOps
from kiln.models.layers.moe_router import Scoring, UnsupportedVariant
from kiln.models.layers.ops import TorchOps

# GLM-4.5-Air's config.json (as Z.ai publishes it), the sizes that matter here
GLM_45_AIR = {
    "architectures": ["Glm4MoeForCausalLM"], "attention_bias": True, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 4096, "partial_rotary_factor": 0.5,
    "intermediate_size": 10944, "max_position_embeddings": 4096, "model_type": "glm4_moe",
    "moe_intermediate_size": 1408, "norm_topk_prob": True, "num_attention_heads": 96,
    "n_group": 1, "topk_group": 1, "n_routed_experts": 128, "n_shared_experts": 1,
    "routed_scaling_factor": 1.0, "num_experts_per_tok": 8, "first_k_dense_replace": 1,
    "num_hidden_layers": 46, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
    "rope_scaling": None, "rope_theta": 1000000, "num_nextn_predict_layers": 1,
    "tie_word_embeddings": False, "use_qk_norm": False, "vocab_size": 151552,
}


def test_glm_45_air_config():
    a = Glm4MoeArch.from_hf(GLM_45_AIR, "Glm4MoeForCausalLM")
    assert (a.rotary_dim, a.head_dim, a.first_sparse_layer, a.mtp_layers) == (64, 128, 1, 1)
    assert a.qkv_bias and not a.qk_norm
    r = a.moe.router
    assert (r.scoring, r.num_experts, r.top_k, r.selection_bias, r.grouped) == (
        Scoring.SIGMOID, 128, 8, True, False)
    assert (a.moe.shared_intermediate_size, a.moe.shared_expert_name) == (1408, "shared_experts")


def test_rope_parameters_factor_and_glm_defaults():
    """transformers 5 writes the factor into rope_parameters; absent routing fields take
    Glm4MoeConfig's defaults (one group, scale 1, one shared expert), not DeepSeek-V3's."""
    cfg = {k: v for k, v in GLM_45_AIR.items() if k not in (
        "partial_rotary_factor", "n_group", "topk_group", "routed_scaling_factor",
        "n_shared_experts")}
    cfg["rope_parameters"] = {"rope_theta": 1e6, "rope_type": "default",
                              "partial_rotary_factor": 0.25}
    a = Glm4MoeArch.from_hf(cfg, "Glm4MoeForCausalLM")
    assert a.rotary_dim == 32
    assert (a.moe.router.num_groups, a.moe.router.scaling_factor,
            a.moe.shared_intermediate_size) == (1, 1.0, 1408)


@pytest.mark.parametrize("change, field", [
    ({"partial_rotary_factor": 0.2}, "partial_rotary_factor"),  # 25 dims: no rotate-half
    ({"partial_rotary_factor": 0.0}, "partial_rotary_factor"),
    ({"rope_parameters": {"partial_rotary_factor": 0.25}}, "partial_rotary_factor"),  # 0.5 too
    ({"q_lora_rank": 1536}, "q_lora_rank"),
    ({"scoring_func": "softmax"}, "scoring_func"),
    ({"index_n_heads": 64}, "index_n_heads"),  # a sparse-attention indexer's field
    ({"n_routed_experts": None}, "n_routed_experts"),
])
def test_variants_name_their_field(change, field):
    with pytest.raises(UnsupportedVariant) as err:
        Glm4MoeArch.from_hf({**GLM_45_AIR, **change}, "Glm4MoeForCausalLM")
    assert err.value.field == field


def test_partial_rotary_turns_only_the_leading_dims():
    """Positions 0..2 of a [3, 1, 8] head with rotary_dim 4: the first 4 dims equal the full
    rotation of a 4-dim head, the last 4 pass through."""
    from kiln.models.layers.rotary import RotaryEmbedding

    rotary = RotaryEmbedding(4, 16, 10000.0)
    q = torch.randn(3, 1, 8, generator=torch.Generator().manual_seed(0))
    positions = torch.arange(3)
    got, _ = PartialRotaryOps(TorchOps(), 4).rotary(q, q, positions, rotary.cos, rotary.sin)
    whole, _ = TorchOps().rotary(q[..., :4], q[..., :4], positions, rotary.cos, rotary.sin)
    torch.testing.assert_close(got[..., :4], whole)
    assert torch.equal(got[..., 4:], q[..., 4:])
    assert not torch.equal(got[1:, :, :4], q[1:, :, :4])  # position 0 is the identity
