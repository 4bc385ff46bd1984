"""The MoE router, shared-expert gate and fused experts, with exact values."""

from __future__ import annotations

import math

import pytest
import torch

from kiln.models.layers.experts import FusedExperts
from kiln.models.layers.moe import SparseMoeBlock
from kiln.models.layers.moe_config import MoeShape, check_moe_fields, deepseek_moe_shape
from kiln.models.layers.moe_router import RouterSpec, Routing, Scoring, UnsupportedVariant, route
from kiln.models.layers.ops import TorchOps

# softmax(log p) = p: the scores are exactly 0.4, 0.3, 0.2, 0.1 (experts 2, 0, 3, 1)
LOGITS = torch.tensor([[math.log(0.3), math.log(0.1), math.log(0.4), math.log(0.2)]])


def spec(top_k: int, normalize: bool, num_experts: int = 4) -> RouterSpec:
    return RouterSpec(num_experts, top_k, Scoring.SOFTMAX, normalize)


def test_mixtral_softmax_top2_renormalized():
    r = route(LOGITS, spec(2, normalize=True))
    assert r.experts.tolist() == [[2, 0]]
    torch.testing.assert_close(r.weights, torch.tensor([[4 / 7, 3 / 7]]))
    assert r.weights.dtype == torch.float32


@pytest.mark.parametrize("normalize, expected", [
    (False, [0.4, 0.3, 0.2]),  # Qwen's norm_topk_prob off: the softmax scores themselves
    (True, [4 / 9, 3 / 9, 2 / 9]),  # on: the three chosen rescaled to sum to 1
])
def test_qwen_norm_topk_prob(normalize, expected):
    r = route(LOGITS, spec(3, normalize))
    assert r.experts.tolist() == [[2, 0, 3]]
    torch.testing.assert_close(r.weights, torch.tensor([expected]))


def test_router_scores_bf16_logits_in_fp32():
    r = route(LOGITS.bfloat16(), spec(2, normalize=False))
    assert r.experts.tolist() == [[2, 0]] and r.weights.dtype == torch.float32


def test_top_k_beyond_the_experts_names_the_field():
    with pytest.raises(UnsupportedVariant, match="5 experts per token with 4") as err:
        spec(5, normalize=True)
    assert err.value.field == "num_experts_per_tok"


def tiny_block(shared: bool, num_experts: int = 6, top_k: int = 2, hidden: int = 8,
               seed: int = 0) -> SparseMoeBlock:
    shape = MoeShape(hidden, 12, spec(top_k, True, num_experts),
                     shared_intermediate_size=10 if shared else None, shared_expert_gate=shared)
    block = SparseMoeBlock(shape, "mlp", lambda prefix: None, torch.float32, TorchOps())
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    return block


def per_token_reference(experts: FusedExperts, x: torch.Tensor, r: Routing) -> torch.Tensor:
    """sum_j w_j * Expert_{ids_j}(x), one token and one expert at a time."""
    rows = []
    for t in range(x.shape[0]):
        row = torch.zeros(x.shape[1])
        for j in range(r.experts.shape[1]):
            row += r.weights[t, j] * experts[int(r.experts[t, j])](x[t:t + 1])[0]
        rows.append(row)
    return torch.stack(rows)


@pytest.mark.parametrize("num_tokens", [1, 7, 40])
def test_fused_experts_match_a_per_token_loop(num_tokens):
    block = tiny_block(shared=False)
    x = torch.randn(num_tokens, 8, generator=torch.Generator().manual_seed(num_tokens))
    routing = block.gate(x)
    torch.testing.assert_close(block.experts(x, routing),
                               per_token_reference(block.experts, x, routing))


def test_every_token_on_the_same_experts():
    block = tiny_block(shared=False)
    x = torch.randn(5, 8)
    routing = Routing(torch.tensor([[0.75, 0.25]] * 5), torch.tensor([[3, 1]] * 5))
    torch.testing.assert_close(block.experts(x, routing),
                               per_token_reference(block.experts, x, routing))


def test_batch_one_runs_only_its_routed_experts():
    """Decode reads the k routed experts' weights, none of the others'."""
    block = tiny_block(shared=False, num_experts=8, top_k=2)
    called: list[int] = []
    for e, expert in enumerate(block.experts):
        expert.register_forward_pre_hook(lambda m, args, e=e: called.append(e))
    x = torch.randn(1, 8)
    routed = sorted(block.gate(x).experts[0].tolist())
    block(x)
    assert called == routed


def test_shared_expert_scaled_by_its_sigmoid_gate():
    """y = routed + sigmoid(x w_s^T) * shared(x); w_s chosen so the gate is exactly 0.75."""
    block = tiny_block(shared=True)
    x = torch.tensor([[1.0, 0, 0, 0, 0, 0, 0, 0]])
    with torch.no_grad():
        block.shared_expert_gate.weight.zero_()[0, 0] = math.log(3.0)  # sigmoid(ln 3) = 3/4
    routed = block.experts(x, block.gate(x))
    torch.testing.assert_close(block(x), routed + 0.75 * block.shared_expert(x))


@pytest.mark.parametrize("field, value", [
    ("scoring_func", "sigmoid"), ("topk_method", "noaux_tc"), ("n_group", 8),
    ("routed_scaling_factor", 2.5), ("q_lora_rank", 1536), ("index_topk", 2048),
    ("moe_router_kind", "hash"),
])
def test_unknown_router_fields_are_named(field, value):
    cfg = {"num_experts": 8, "num_experts_per_tok": 2, field: value}
    with pytest.raises(UnsupportedVariant, match=field) as err:
        check_moe_fields(cfg, ("num_experts", "num_experts_per_tok"), "Qwen3Moe")
    assert err.value.field == field


def test_default_variant_values_and_known_fields_pass():
    cfg = {"num_experts": 8, "num_experts_per_tok": 2, "scoring_func": "softmax", "n_group": 1,
           "hidden_act": "silu", "router_aux_loss_coef": 0.001}
    check_moe_fields(cfg, ("num_experts", "num_experts_per_tok", "router_aux_loss_coef"), "X")


def test_gptq_keeps_an_expert_that_calibration_never_routed_to():
    """No calibration token reached it (H = 0): rounded to nearest, not zeroed as dead."""
    from kiln.quant.formats import get_format
    from kiln.quant.gptq import gptq_round

    w = torch.randn(12, 8, generator=torch.Generator().manual_seed(0))
    unseen = gptq_round(w, torch.zeros(8, 8), get_format("int8")).weight
    torch.testing.assert_close(unseen, gptq_round(w, torch.eye(8), get_format("int8")).weight)
    assert (unseen - w).abs().max() < 0.02


# --- DeepSeek-V3 / GLM-4.5: sigmoid scores, score-correction bias, grouped top-k ---

# sigmoid(logit(p)) = p: eight experts in four groups of two, scores
#   group 0: 0.9 0.1 | group 1: 0.8 0.7 | group 2: 0.2 0.3 | group 3: 0.6 0.5
# group scores (sum of the two best): 1.0, 1.5, 0.5, 1.1
SCORES = torch.tensor([[0.9, 0.1, 0.8, 0.7, 0.2, 0.3, 0.6, 0.5]])
SIGMOID_LOGITS = torch.logit(SCORES.double()).float()


def sigmoid_spec(normalize: bool = True, scale: float = 1.0, top_k_groups: int = 2,
                 num_groups: int = 4) -> RouterSpec:
    return RouterSpec(8, 2, Scoring.SIGMOID, normalize, num_groups=num_groups,
                      top_k_groups=top_k_groups, selection_bias=True, scaling_factor=scale)


def sorted_routing(r: Routing) -> tuple[list[list[int]], torch.Tensor]:
    """(expert ids, weights) with each token's slots in expert-id order."""
    ids, order = r.experts.sort(dim=-1)
    return ids.tolist(), r.weights.gather(1, order)


def test_sigmoid_top_k_without_groups_or_bias():
    r = route(SIGMOID_LOGITS, sigmoid_spec(normalize=False, num_groups=1, top_k_groups=1))
    ids, weights = sorted_routing(r)
    assert ids == [[0, 2]]  # the two best scores, 0.9 and 0.8, un-normalized
    torch.testing.assert_close(weights, torch.tensor([[0.9, 0.8]]))


def test_grouped_top_k_keeps_the_two_best_groups():
    """Groups 1 (1.5) and 3 (1.1) win: expert 0, the best score, is in a losing group."""
    ids, weights = sorted_routing(route(SIGMOID_LOGITS, sigmoid_spec(), torch.zeros(8)))
    assert ids == [[2, 3]]
    torch.testing.assert_close(weights, torch.tensor([[0.8 / 1.5, 0.7 / 1.5]]))


def test_routed_scaling_factor_multiplies_the_normalized_weights():
    ids, weights = sorted_routing(route(SIGMOID_LOGITS, sigmoid_spec(scale=2.5), torch.zeros(8)))
    assert ids == [[2, 3]]
    torch.testing.assert_close(weights, torch.tensor([[2.5 * 0.8 / 1.5, 2.5 * 0.7 / 1.5]]))


def test_norm_topk_prob_off_keeps_the_scaled_sigmoid_scores():
    _, weights = sorted_routing(route(SIGMOID_LOGITS, sigmoid_spec(normalize=False, scale=2.5),
                                      torch.zeros(8)))
    torch.testing.assert_close(weights, torch.tensor([[2.5 * 0.8, 2.5 * 0.7]]))


def test_bias_changes_the_choice_not_the_weights():
    """+0.3 on expert 6 (choice 0.9) beats expert 3 (0.7); its weight is still its score 0.6."""
    bias = torch.tensor([0, 0, 0, 0, 0, 0, 0.3, 0])
    ids, weights = sorted_routing(route(SIGMOID_LOGITS, sigmoid_spec(), bias))
    assert ids == [[2, 6]]
    torch.testing.assert_close(weights, torch.tensor([[0.8 / 1.4, 0.6 / 1.4]]))


def test_bias_changes_which_groups_win():
    """+0.6 on expert 1 lifts group 0 to 0.9 + 0.7 = 1.6: groups 0 and 1 now win."""
    bias = torch.tensor([0, 0.6, 0, 0, 0, 0, 0, 0])
    ids, weights = sorted_routing(route(SIGMOID_LOGITS, sigmoid_spec(), bias))
    assert ids == [[0, 2]]
    torch.testing.assert_close(weights, torch.tensor([[0.9 / 1.7, 0.8 / 1.7]]))


@pytest.mark.parametrize("kw, field", [
    (dict(num_groups=3), "n_group"),  # 8 experts do not split in 3
    (dict(num_groups=8), "n_group"),  # one expert per group: no two best
    (dict(top_k_groups=5), "topk_group"),
    (dict(top_k_groups=1), "num_experts_per_tok"),  # one group of 2 experts, k = 3
])
def test_group_shapes_kiln_cannot_route_name_their_field(kw, field):
    args = dict(num_groups=4, top_k_groups=2) | kw
    top_k = 3 if field == "num_experts_per_tok" else 2
    with pytest.raises(UnsupportedVariant) as err:
        RouterSpec(8, top_k, Scoring.SIGMOID, True, selection_bias=True, **args)
    assert err.value.field == field


def hf_router_pair(model_type: str, seed: int):
    """transformers' own router of `model_type` with random weights and bias, and kiln's
    Router from deepseek_moe_shape of the same config, holding the same tensors."""
    from transformers import AutoConfig

    cfg = dict(hidden_size=32, n_routed_experts=16, num_experts_per_tok=4, n_group=4,
               topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
               moe_intermediate_size=8, n_shared_experts=1)
    if model_type == "glm4_moe":
        cfg.update(n_group=1, topk_group=1, routed_scaling_factor=1.0)
    config = AutoConfig.for_model(model_type, **cfg)
    module = __import__(f"transformers.models.{model_type}.modeling_{model_type}",
                        fromlist=["x"])
    router_cls = {"deepseek_v3": "DeepseekV3TopkRouter", "glm4_moe": "Glm4MoeTopkRouter"}
    hf = getattr(module, router_cls[model_type])(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(hf.weight.shape, generator=gen) / 32 ** 0.5)
        hf.e_score_correction_bias.copy_(0.1 * torch.randn(16, generator=gen))
    shape = deepseek_moe_shape(config.to_dict())
    kiln = SparseMoeBlock(shape, "mlp", lambda prefix: None, torch.bfloat16, TorchOps()).gate
    with torch.no_grad():
        kiln.weight.copy_(hf.weight)
        kiln.e_score_correction_bias.copy_(hf.e_score_correction_bias)
    return hf, kiln


@pytest.mark.parametrize("model_type", ["deepseek_v3", "glm4_moe"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_router_equals_transformers_on_random_tokens(model_type, dtype):
    """The same experts and the same weights as transformers' router module, bf16 activations
    included (both keep the gate weight in fp32 and route in fp32)."""
    hf, kiln = hf_router_pair(model_type, seed=1)
    assert kiln.weight.dtype == torch.float32  # even in a bf16 model
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(2)).to(dtype)
    with torch.no_grad():
        _, hf_weights, hf_ids = hf(x)
    hf_ids, order = hf_ids.sort(dim=-1)
    ids, weights = sorted_routing(kiln(x))
    assert ids == hf_ids.tolist()
    torch.testing.assert_close(weights, hf_weights.gather(1, order), rtol=1e-6, atol=0)


def test_shared_experts_always_on_without_a_gate():
    """DeepSeek's block: y = routed + SharedExperts(x), n_shared_experts x moe_intermediate
    wide, under HF's name `shared_experts`; the same output as transformers' DeepseekV3MoE."""
    from transformers import AutoConfig
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    config = AutoConfig.for_model(
        "deepseek_v3", hidden_size=16, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
        topk_group=2, routed_scaling_factor=2.5, moe_intermediate_size=6, n_shared_experts=2)
    hf = DeepseekV3MoE(config).eval()
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in list(hf.parameters()) + [hf.gate.e_score_correction_bias]:
            p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    block = SparseMoeBlock(deepseek_moe_shape(config.to_dict()), "mlp", lambda prefix: None,
                           torch.float32, TorchOps())
    assert block.shared_expert_gate is None
    assert block.shared_experts.down_proj.in_features == 12  # 2 experts x 6
    copy_hf_moe(hf, block)
    x = torch.randn(9, 16, generator=gen)
    with torch.no_grad():
        torch.testing.assert_close(block(x), hf(x.unsqueeze(0))[0])
        routed = block.experts(x, block.gate(x))
        torch.testing.assert_close(block(x), routed + block.shared_experts(x))


def copy_hf_moe(hf, block: SparseMoeBlock) -> None:
    """transformers' stacked expert tensors [E, 2I, H] / [E, H, I] into kiln's per-expert
    linears (gate rows first, as HF's chunk(2) reads them)."""
    with torch.no_grad():
        block.gate.weight.copy_(hf.gate.weight)
        block.gate.e_score_correction_bias.copy_(hf.gate.e_score_correction_bias)
        for e, expert in enumerate(block.experts):
            expert.gate_up_proj.weight.copy_(hf.experts.gate_up_proj[e])
            expert.down_proj.weight.copy_(hf.experts.down_proj[e])
        shared = hf.shared_experts
        block.shared_experts.gate_up_proj.weight.copy_(
            torch.cat([shared.gate_proj.weight, shared.up_proj.weight]))
        block.shared_experts.down_proj.weight.copy_(shared.down_proj.weight)


DEEPSEEK_V3_CONFIG = {
    "hidden_size": 7168, "moe_intermediate_size": 2048, "n_routed_experts": 256,
    "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5,
    "norm_topk_prob": True, "n_shared_experts": 1, "topk_method": "noaux_tc",
    "scoring_func": "sigmoid", "first_k_dense_replace": 3, "moe_layer_freq": 1,
    "kv_lora_rank": 512, "q_lora_rank": 1536, "hidden_act": "silu", "aux_loss_alpha": 0.001,
    "seq_aux": True, "ep_size": 1, "num_nextn_predict_layers": 1,
}


def test_deepseek_moe_shape_reads_deepseek_v3():
    shape = deepseek_moe_shape(DEEPSEEK_V3_CONFIG)
    assert shape == MoeShape(
        7168, 2048, RouterSpec(256, 8, Scoring.SIGMOID, True, num_groups=8, top_k_groups=4,
                               selection_bias=True, scaling_factor=2.5, fp32_weight=True),
        shared_intermediate_size=2048, shared_expert_name="shared_experts")


def test_deepseek_moe_shape_defaults_are_transformers_deepseek_v3s():
    cfg = {k: DEEPSEEK_V3_CONFIG[k] for k in ("hidden_size", "moe_intermediate_size",
                                              "n_routed_experts", "num_experts_per_tok")}
    assert deepseek_moe_shape(cfg) == deepseek_moe_shape(DEEPSEEK_V3_CONFIG)


@pytest.mark.parametrize("field, value", [
    ("scoring_func", "softmax"),  # DeepSeek-V2's scores
    ("topk_method", "group_limited_greedy"),  # DeepSeek-V2's group rule
    ("topk_method", "greedy"),
    ("index_topk", 2048),  # DeepSeek-V3.2's sparse-attention indexer
    ("moe_layer_freq", 2),
    ("hidden_act", "gelu"),
    ("router_kind", "hash"),  # a routing option kiln has never seen
    ("n_routed_experts", None),  # missing
    ("n_group", 6),  # 256 experts do not split in 6
    ("topk_group", 9),
])
def test_deepseek_variants_kiln_does_not_run_name_their_field(field, value):
    with pytest.raises(UnsupportedVariant, match=field) as err:
        deepseek_moe_shape({**DEEPSEEK_V3_CONFIG, field: value})
    assert err.value.field == field


@pytest.mark.parametrize("normalize", [False, True])
def test_kernel_route_chooses_as_route(normalize):
    """kiln's route_softmax op (the packed Router's and the fused stack's) picks the same
    experts in the same order as `route`, with weights equal to fp32 rounding, on bf16 logits
    of 64 experts (ties included: bf16 logits repeat) and on the exact-value example."""
    from kiln.kernels import cpu

    if not cpu.load():
        pytest.skip("kiln CPU kernels did not build")
    weights, experts = torch.ops.kiln.route_softmax(LOGITS, 3, normalize)
    assert experts.tolist() == [[2, 0, 3]]
    torch.testing.assert_close(weights, route(LOGITS, spec(3, normalize)).weights)
    logits = torch.randn(200, 64, generator=torch.Generator().manual_seed(3)).bfloat16()
    weights, experts = torch.ops.kiln.route_softmax(logits, 8, normalize)
    ref = route(logits, spec(8, normalize, num_experts=64))
    scores = torch.softmax(logits.float(), -1)
    # a tie may order differently; the chosen scores, best first, are the same
    torch.testing.assert_close(scores.gather(1, experts), scores.gather(1, ref.experts))
    assert (experts.sort(-1).values == ref.experts.sort(-1).values).float().mean() > 0.97
    torch.testing.assert_close(weights.sort(-1).values, ref.weights.sort(-1).values,
                               rtol=1e-6, atol=1e-7)
    assert torch.all(scores.gather(1, experts)[:, :-1] >= scores.gather(1, experts)[:, 1:])


def test_packed_router_routes_as_the_plain_one():
    """`Router.pack` (VNNI logits, the route_softmax op) against the plain bf16 router: the
    same experts wherever the top-k is not a near tie."""
    from kiln.kernels.bf16_vnni import vnni_available

    if not vnni_available():
        pytest.skip("no AVX512-BF16 here: the router keeps F.linear")
    block = SparseMoeBlock(MoeShape(64, 32, spec(4, True, num_experts=16)), "mlp",
                           lambda prefix: None, torch.bfloat16, TorchOps())
    gate = block.gate
    with torch.no_grad():
        gate.weight.copy_(torch.randn(16, 64, generator=torch.Generator().manual_seed(4)))
    x = torch.randn(50, 64, generator=torch.Generator().manual_seed(5)).bfloat16()
    plain = gate(x)
    gate.pack()
    assert gate.vnni_weight is not None and gate.kernel_route
    packed = gate(x)
    agree = (packed.experts.sort(-1).values == plain.experts.sort(-1).values).all(-1)
    assert agree.float().mean() >= 0.9
    torch.testing.assert_close(packed.weights[agree], plain.weights[agree], rtol=2e-2, atol=1e-3)
