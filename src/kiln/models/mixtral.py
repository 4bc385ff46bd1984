"""Mixtral (Jiang et al. 2024, "Mixtral of Experts"): Mistral's decoder with a sparse MoE.

Each block is Llama's, x + Attn(RMSNorm(x)) then h + MoE(RMSNorm(h)), where the MoE block
routes every token to the top 2 of 8 SwiGLU experts by a softmax router and sums their outputs
weighted by the two scores renormalized to 1 (kiln.models.layers.moe). HF names the block
`block_sparse_moe` and an expert's projections w1 (gate), w3 (up) and w2 (down); kiln fuses
w1 and w3 into one `gate_up_proj` per expert, as it fuses gate and up in dense layers. A
sliding window caps `max_model_len` to it (kiln.engine.core), as for Mistral.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from kiln.models.layers.expert_parallel import expert_shard, experts_elsewhere
from kiln.models.layers.moe import SparseMoeBlock
from kiln.models.layers.moe_config import MoeShape, check_moe_fields
from kiln.models.layers.moe_router import RouterSpec, Scoring
from kiln.models.llama import PACKED_MODULES, LlamaArch, LlamaDecoderLayer, LlamaForCausalLM

# HF expert module name -> (kiln fused module, shard index)
MIXTRAL_PACKED_MODULES = {
    **{k: v for k, v in PACKED_MODULES.items() if v[0] == "qkv_proj"},
    "w1": ("gate_up_proj", 0), "w3": ("gate_up_proj", 1), "w2": ("down_proj", 0),
}
# routing entries of a Mixtral config.json that kiln reads or may ignore (training only)
_KNOWN_FIELDS = ("num_local_experts", "num_experts_per_tok", "router_aux_loss_coef",
                 "output_router_logits", "router_jitter_noise")


@dataclass(frozen=True)
class MixtralArch(LlamaArch):
    moe: MoeShape  # every layer's sparse block

    @classmethod
    def from_hf(cls, cfg: dict, arch: str) -> MixtralArch:
        check_moe_fields(cfg, _KNOWN_FIELDS, "Mixtral")
        base = LlamaArch.from_hf(cfg, arch)
        router = RouterSpec(num_experts=cfg["num_local_experts"],
                            top_k=cfg.get("num_experts_per_tok", 2), scoring=Scoring.SOFTMAX,
                            normalize_top_k=True)
        return cls(**asdict(base), moe=MoeShape(base.hidden_size, base.intermediate_size, router))


class MixtralDecoderLayer(LlamaDecoderLayer):
    def __init__(self, a: MixtralArch, index: int, method_for, dtype, backend, ops, tp):
        self.index = index
        super().__init__(a, f"model.layers.{index}", method_for, dtype, backend, ops, tp)

    def add_feed_forward(self, a: MixtralArch, prefix, method_for, dtype, ops, tp) -> None:
        shard = expert_shard(tp, self.index, a.moe.router.num_experts)
        self.block_sparse_moe = SparseMoeBlock(a.moe, f"{prefix}.block_sparse_moe", method_for,
                                               dtype, ops, shard, self.index)

    def feed_forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.block_sparse_moe(h)

    def dense_mlp(self) -> None:
        return None

    def sparse_moe(self) -> SparseMoeBlock:
        return self.block_sparse_moe


class MixtralForCausalLM(LlamaForCausalLM):
    tensor_parallel_layers = True  # attention split by heads, experts by expert_shard

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.unused_checkpoint_prefixes = experts_elsewhere(self)  # expert parallelism
    packed_modules = MIXTRAL_PACKED_MODULES

    def layer_maker(self, a, method_for, dtype, backend, ops):
        return lambda i: MixtralDecoderLayer(a, i, method_for, dtype, backend, ops, self.tp)
