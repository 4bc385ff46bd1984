"""The MoE router, shared-expert gate and fused experts, with exact values."""

from __future__ import annotations

import math

import pytest
import torch

from kiln.models.layers.moe import (
    FusedExperts,
    MoeShape,
    RouterSpec,
    Routing,
    Scoring,
    SparseMoeBlock,
    UnsupportedVariant,
    check_moe_fields,
    route,
)
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
