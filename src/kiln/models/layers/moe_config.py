"""What config.json says of a sparse mixture-of-experts block: its sizes (`MoeShape`), the
routing variants kiln runs (`check_moe_fields`) and DeepSeek-V3 / GLM-4.5's shared fields
(`deepseek_moe_shape`). A config asking for a variant kiln does not run fails at load
(`UnsupportedVariant`), never with wrong tokens.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from kiln.models.layers.moe_router import RouterSpec, Scoring, UnsupportedVariant


@dataclass(frozen=True)
class MoeShape:
    """The sizes of one sparse block."""

    hidden_size: int
    expert_intermediate_size: int
    router: RouterSpec
    # the always-on expert's width (None: none; DeepSeek's n_shared_experts experts are one
    # MLP n_shared_experts times as wide), whether a sigmoid gate scales it (Qwen2-MoE), and
    # its checkpoint name (Qwen's `shared_expert`, DeepSeek's and GLM's `shared_experts`)
    shared_intermediate_size: int | None = None
    shared_expert_gate: bool = False
    shared_expert_name: str = "shared_expert"


# config.json entries that mean a routing or attention variant (DeepSeek's router groups,
# bias and scaling, MLA, the sparse-attention indexer) and the values kiln's MoE families
# run; any other value fails at load.
_VARIANT_DEFAULTS: Mapping[str, tuple] = {
    "scoring_func": (None, "softmax"),
    "topk_method": (None, "greedy"),
    "n_group": (None, 1),
    "topk_group": (None, 1),
    "routed_scaling_factor": (None, 1, 1.0),
    "n_shared_experts": (None, 0),
    "n_routed_experts": (None,),
    "first_k_dense_replace": (None, 0),
    "moe_layer_freq": (None, 1),
    "kv_lora_rank": (None,),
    "q_lora_rank": (None,),
    "index_topk": (None,),
    "hidden_act": (None, "silu"),
}
# words that mark a config entry as part of the routing scheme: such an entry must be one a
# family's parser reads (or a training-only knob it lists), else kiln cannot tell whether the
# checkpoint routes the way kiln computes
_ROUTING_WORDS = ("router", "expert", "topk", "top_k", "moe", "scoring", "routed", "n_group",
                  "lora_rank", "index_")


def check_moe_fields(cfg: Mapping, known: Iterable[str], family: str,
                     variants: Mapping[str, tuple] = _VARIANT_DEFAULTS) -> None:
    """Raise UnsupportedVariant naming the first entry of `cfg` that asks for a variant kiln's
    `family` does not run: a `variants` field (name -> the values kiln runs, None: absent)
    with another value, or a routing entry the family does not know (`known`: the entries
    it reads or may ignore)."""
    known = frozenset(known)
    for field, accepted in variants.items():
        if cfg.get(field) not in accepted:
            runs = "" if accepted[-1] is None else f" (it runs {accepted[-1]!r})"
            raise UnsupportedVariant(field, f"{cfg[field]!r} is not supported by kiln's "
                                     f"{family}{runs}")
    for field in cfg:
        if field not in known and field not in variants and any(
                word in field for word in _ROUTING_WORDS):
            raise UnsupportedVariant(field, f"unknown routing option for {family}; kiln "
                                     f"reads only {', '.join(sorted(known))}")


# DeepSeek-V3's and GLM-4.5's routing entries that kiln reads (deepseek_moe_shape; the model
# files read first_k_dense_replace, MLA's attention reads the lora ranks) or may ignore
# (training only)
DEEPSEEK_ROUTING_FIELDS = (
    "n_routed_experts", "num_experts_per_tok", "n_group", "topk_group", "routed_scaling_factor",
    "norm_topk_prob", "n_shared_experts", "moe_intermediate_size", "topk_method",
    "scoring_func", "first_k_dense_replace", "moe_layer_freq", "kv_lora_rank", "q_lora_rank",
    "output_router_logits", "router_aux_loss_coef")
# the values of DeepSeek-V3's variant fields that kiln computes: sigmoid scores with the
# bias-corrected grouped top-k ("noaux_tc"), every layer past the first dense ones sparse, no
# sparse-attention indexer (DeepSeek-V3.2), SiLU experts
DEEPSEEK_VARIANTS: Mapping[str, tuple] = {
    "scoring_func": (None, "sigmoid"),
    "topk_method": (None, "noaux_tc"),
    "moe_layer_freq": (None, 1),
    "index_topk": (None,),
    "hidden_act": (None, "silu"),
}


# what transformers' DeepseekV3Config assumes for an absent (or null) optional field
DEEPSEEK_V3_DEFAULTS: Mapping[str, object] = {
    "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
    "n_shared_experts": 1,
}


def deepseek_moe_shape(cfg: dict, family: str = "DeepseekV3",
                       defaults: Mapping[str, object] = DEEPSEEK_V3_DEFAULTS) -> MoeShape:
    """The sparse block of DeepSeek-V3 and GLM-4.5 from their shared config.json fields:
    sigmoid router with the score-correction bias, n_group/topk_group grouped top-k,
    norm_topk_prob, routed_scaling_factor, and n_shared_experts always-on experts of
    moe_intermediate_size each (one MLP that wide). An absent optional field takes the
    family's HF default (`defaults`). Raises UnsupportedVariant naming the field of a
    variant kiln does not run."""
    check_moe_fields(cfg, DEEPSEEK_ROUTING_FIELDS, family, DEEPSEEK_VARIANTS)

    def get(field: str):
        return defaults[field] if cfg.get(field) is None else cfg[field]

    width = _required(cfg, "moe_intermediate_size")
    router = RouterSpec(
        num_experts=_required(cfg, "n_routed_experts"),
        top_k=_required(cfg, "num_experts_per_tok"), scoring=Scoring.SIGMOID,
        normalize_top_k=bool(get("norm_topk_prob")), num_groups=get("n_group"),
        top_k_groups=get("topk_group"), selection_bias=True,
        scaling_factor=float(get("routed_scaling_factor")), fp32_weight=True)
    shared = get("n_shared_experts")
    if shared < 0:
        raise UnsupportedVariant("n_shared_experts", f"{shared}; need >= 0")
    return MoeShape(_required(cfg, "hidden_size"), width, router,
                    shared_intermediate_size=shared * width or None,
                    shared_expert_name="shared_experts")


def _required(cfg: Mapping, field: str) -> int:
    if cfg.get(field) is None:
        raise UnsupportedVariant(field, "missing; the sparse layers need it")
    return cfg[field]
