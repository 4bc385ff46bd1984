"""Qwen's mixtures of experts: Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B) and Qwen3-MoE.

Llama's block with the MLP replaced by a sparse MoE (kiln.models.layers.moe) in every layer
the config makes sparse: softmax router, top k of E fine-grained SwiGLU experts, whose k
scores are renormalized to sum to 1 only where `norm_topk_prob` says so. Qwen2-MoE adds an
always-on shared expert scaled per token by sigmoid(x w_s^T) and keeps q/k/v biases; Qwen3-MoE
has no shared expert and Qwen3's RMSNorm on each q and k head. Layers listed in
`mlp_only_layers`, or off the `decoder_sparse_step` stride, keep a dense MLP.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from kiln.models.layers.expert_parallel import expert_shard, experts_elsewhere
from kiln.models.layers.moe import SparseMoeBlock
from kiln.models.layers.moe_config import MoeShape, check_moe_fields
from kiln.models.layers.moe_router import RouterSpec, Scoring, UnsupportedVariant
from kiln.models.llama import LlamaArch, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP

# routing entries of a Qwen MoE config.json that kiln reads or may ignore (training only);
# transformers 5 writes Qwen3-MoE's expert count as num_local_experts
_KNOWN_FIELDS = ("num_experts", "num_local_experts", "num_experts_per_tok",
                 "moe_intermediate_size", "shared_expert_intermediate_size", "norm_topk_prob",
                 "decoder_sparse_step", "mlp_only_layers", "router_aux_loss_coef",
                 "output_router_logits")


@dataclass(frozen=True)
class QwenMoeArch(LlamaArch):
    moe: MoeShape
    sparse_layers: frozenset[int]  # layer indices with a sparse block (the rest: dense MLP)

    @classmethod
    def from_hf(cls, cfg: dict, arch: str) -> QwenMoeArch:
        family = arch.removesuffix("ForCausalLM")
        check_moe_fields(cfg, _KNOWN_FIELDS, family)
        qwen2 = arch == "Qwen2MoeForCausalLM"
        base = asdict(LlamaArch.from_hf(cfg, arch))
        base.update(qkv_bias=cfg.get("qkv_bias", True) if qwen2 else base["qkv_bias"],
                    qk_norm=not qwen2)
        shared = cfg.get("shared_expert_intermediate_size") if qwen2 else None
        num_experts = cfg.get("num_experts", cfg.get("num_local_experts"))
        router = RouterSpec(num_experts=num_experts, top_k=cfg["num_experts_per_tok"],
                            scoring=Scoring.SOFTMAX,
                            normalize_top_k=bool(cfg.get("norm_topk_prob", False)))
        moe = MoeShape(cfg["hidden_size"], cfg["moe_intermediate_size"], router,
                       shared_intermediate_size=shared or None, shared_expert_gate=bool(shared))
        return cls(**base, moe=moe, sparse_layers=_sparse_layers(cfg, base["num_layers"]))


def _sparse_layers(cfg: dict, num_layers: int) -> frozenset[int]:
    """As HF: sparse unless listed in mlp_only_layers, every decoder_sparse_step-th layer."""
    step, dense = cfg.get("decoder_sparse_step", 1), set(cfg.get("mlp_only_layers") or ())
    if step < 1:
        raise UnsupportedVariant("decoder_sparse_step", f"{step}; need >= 1")
    return frozenset(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)


class QwenMoeDecoderLayer(LlamaDecoderLayer):
    """A block whose `mlp` is the sparse block, or Llama's dense MLP in dense layers."""

    def __init__(self, a: QwenMoeArch, index: int, method_for, dtype, backend, ops, tp):
        self.sparse, self.index = index in a.sparse_layers, index
        super().__init__(a, f"model.layers.{index}", method_for, dtype, backend, ops, tp)

    def add_feed_forward(self, a: QwenMoeArch, prefix, method_for, dtype, ops, tp) -> None:
        if self.sparse:
            shard = expert_shard(tp, self.index, a.moe.router.num_experts)
            self.mlp = SparseMoeBlock(a.moe, f"{prefix}.mlp", method_for, dtype, ops, shard,
                                      self.index)
        else:
            self.mlp = LlamaMLP(a, f"{prefix}.mlp", method_for, dtype, ops, tp)

    def dense_mlp(self) -> LlamaMLP | None:
        return None if self.sparse else self.mlp

    def sparse_moe(self) -> SparseMoeBlock | None:
        return self.mlp if self.sparse else None


class QwenMoeForCausalLM(LlamaForCausalLM):
    tensor_parallel_layers = True  # attention split by heads, experts by expert_shard

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.unused_checkpoint_prefixes = experts_elsewhere(self)  # expert parallelism
    def layer_maker(self, a, method_for, dtype, backend, ops):
        return lambda i: QwenMoeDecoderLayer(a, i, method_for, dtype, backend, ops, self.tp)
