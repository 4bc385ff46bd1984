"""GLM-4.5 (Zhipu AI / Z.ai 2025, "GLM-4.5: Agentic, Reasoning, and Coding Foundation Models").

Llama's pre-norm block, x + Attn(RMSNorm(x)) then h + FFN(RMSNorm(h)), differing in:

- attention: grouped-query heads with q/k/v biases (`attention_bias`), an optional RMSNorm on
  each q and k head (`use_qk_norm`, GLM-4.5 but not -Air), and *partial* rotary: only the
  first `partial_rotary_factor * head_dim` dimensions of each q/k head rotate (rotate-half
  layout over those), the rest pass through unchanged;
- feed-forward: the first `first_k_dense_replace` layers keep a dense SwiGLU MLP, every later
  one is DeepSeek-V3's sparse block (kiln.models.layers.moe_config.deepseek_moe_shape): a sigmoid
  router with the score-correction bias and grouped top-k, `n_shared_experts` always-on
  experts named `shared_experts`.

The checkpoint may end with `num_nextn_predict_layers` multi-token-prediction layers
(`model.layers.{N}` onwards, for speculative decoding); kiln does not run them and skips their
tensors at load, as vLLM does without its MTP drafter.

The C++ and Triton rotary kernels rotate whole heads, so GLM's layers rotate through
`PartialRotaryOps` (torch ops on the rotated slice, the platform's kernels for everything
else) and decline the fused C++ decoder stack.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from kiln.models.layers.expert_parallel import experts_elsewhere
from kiln.models.layers.moe_config import MoeShape, deepseek_moe_shape
from kiln.models.layers.moe_router import UnsupportedVariant
from kiln.models.layers.ops import TorchOps, split_heads
from kiln.models.layers.rotary import RotaryEmbedding
from kiln.models.llama import LlamaArch, LlamaForCausalLM
from kiln.models.qwen_moe import QwenMoeDecoderLayer

# transformers' Glm4MoeConfig defaults for the routing fields a config.json may omit
GLM4_MOE_DEFAULTS = {"n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0,
                     "norm_topk_prob": True, "n_shared_experts": 1}
# multi-head latent attention's fields (DeepSeek's): a GLM config naming them is another model
_MLA_FIELDS = ("kv_lora_rank", "q_lora_rank")


@dataclass(frozen=True)
class Glm4MoeArch(LlamaArch):
    moe: MoeShape
    first_sparse_layer: int  # first_k_dense_replace: layers before it keep a dense MLP
    rotary_dim: int  # the leading dims of each head that rotate (head_dim * partial factor)
    mtp_layers: int  # num_nextn_predict_layers: checkpoint layers after the last, not run

    @property
    def sparse_layers(self) -> frozenset[int]:
        return frozenset(range(self.first_sparse_layer, self.num_layers))

    @classmethod
    def from_hf(cls, cfg: dict, arch: str) -> Glm4MoeArch:
        for field in _MLA_FIELDS:
            if cfg.get(field) is not None:
                raise UnsupportedVariant(field, "multi-head latent attention is not part of "
                                         "kiln's Glm4Moe (grouped-query attention)")
        moe = deepseek_moe_shape({**GLM4_MOE_DEFAULTS, **_present(cfg)}, "Glm4Moe")
        base = asdict(LlamaArch.from_hf(cfg, arch))
        base.update(qk_norm=bool(cfg.get("use_qk_norm", False)))
        first_dense = cfg.get("first_k_dense_replace", 1)
        if first_dense is None or first_dense < 0:
            raise UnsupportedVariant("first_k_dense_replace", f"{first_dense}; need >= 0")
        return cls(**base, moe=moe, first_sparse_layer=first_dense,
                   rotary_dim=_rotary_dim(cfg, base["head_dim"]),
                   mtp_layers=cfg.get("num_nextn_predict_layers") or 0)


def _present(cfg: dict) -> dict:
    """The entries that hold a value (a null one takes the family default, as in HF)."""
    return {k: v for k, v in cfg.items() if v is not None}


def _rotary_dim(cfg: dict, head_dim: int) -> int:
    """head_dim * partial_rotary_factor (HF reads it from rope_parameters, older configs
    from the top level; GLM's default is 0.5)."""
    rope = cfg.get("rope_parameters") or {}
    top, nested = cfg.get("partial_rotary_factor"), rope.get("partial_rotary_factor")
    if top is not None and nested is not None and top != nested:
        raise UnsupportedVariant("partial_rotary_factor", f"{top}, but rope_parameters say "
                                 f"{nested}")
    factor = next((f for f in (nested, top) if f is not None), 0.5)
    dim = int(head_dim * factor)
    if not 2 <= dim <= head_dim or dim % 2:
        raise UnsupportedVariant("partial_rotary_factor", f"{factor} of head_dim {head_dim} "
                                 f"rotates {dim} dims; need an even number in 2..{head_dim}")
    return dim


class PartialRotaryOps:
    """A platform's ops (`inner`) with the rotation confined to the first `rotary_dim` dims of
    each q/k head, as HF's partial rotary: rotate-half over those dims, the rest unchanged.
    The C++/Triton rotary kernels assume whole heads, so the slice rotates through the torch
    reference (`TorchOps.rotary`, tables in the activation dtype, as HF); the norms and
    SiLU-and-multiply stay the platform's kernels."""

    def __init__(self, inner: TorchOps, rotary_dim: int):
        self.inner, self.rotary_dim = inner, rotary_dim

    def rms_norm(self, x, weight, eps):
        return self.inner.rms_norm(x, weight, eps)

    def add_rms_norm(self, x, residual, weight, eps):
        return self.inner.add_rms_norm(x, residual, weight, eps)

    def silu_mul(self, gate_up):
        return self.inner.silu_mul(gate_up)

    def rotary(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
               cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], k [T, Hkv, D]; cos/sin [max_pos, rotary_dim]."""
        r = self.rotary_dim
        q_rot, k_rot = TorchOps.rotary(self.inner, q[..., :r], k[..., :r], positions, cos, sin)
        return torch.cat((q_rot, q[..., r:]), dim=-1), torch.cat((k_rot, k[..., r:]), dim=-1)

    def rotary_qkv(self, qkv, positions, rotary: RotaryEmbedding, num_heads: int,
                   num_kv_heads: int) -> tuple[torch.Tensor, ...]:
        q, k, v = split_heads(qkv, num_heads, num_kv_heads)
        q, k = self.rotary(q, k, positions, rotary.cos, rotary.sin)
        return q, k, v

    def qk_norm_rotary_qkv(self, qkv, positions, rotary: RotaryEmbedding, q_weight, k_weight,
                           eps: float, num_heads: int, num_kv_heads: int):
        """The torch reference's per-head norms, then the partial rotation."""
        return TorchOps.qk_norm_rotary_qkv(self, qkv, positions, rotary, q_weight, k_weight,
                                           eps, num_heads, num_kv_heads)


class Glm4MoeDecoderLayer(QwenMoeDecoderLayer):
    """Qwen-MoE's block (the sparse block in sparse layers, Llama's MLP in the others); its
    sparse layers are those from `first_k_dense_replace` on (`Glm4MoeArch.sparse_layers`)."""

    def dense_mlp(self) -> None:
        # even a dense layer is off the fused C++ stack: the stack rotates whole heads
        return None

    def sparse_moe(self) -> None:
        return None  # (and has no sigmoid router)


class Glm4MoeForCausalLM(LlamaForCausalLM):
    tensor_parallel_layers = True  # attention split by heads, experts by expert_shard
    def __init__(self, a: Glm4MoeArch, *args, **kwargs):
        super().__init__(a, *args, **kwargs)
        first_mtp = a.num_layers  # MTP layers follow the decoder's in the checkpoint
        self.unused_checkpoint_prefixes = tuple(
            f"model.layers.{i}." for i in range(first_mtp, first_mtp + a.mtp_layers)
        ) + experts_elsewhere(self)

    def make_rotary(self, a: Glm4MoeArch, dtype: torch.dtype) -> RotaryEmbedding:
        return RotaryEmbedding(a.rotary_dim, a.max_position_embeddings, a.rope_theta,
                               a.rope_scaling, dtype)

    def layer_maker(self, a: Glm4MoeArch, method_for, dtype, backend, ops):
        if a.rotary_dim < a.head_dim:
            ops = PartialRotaryOps(ops, a.rotary_dim)
        return lambda i: Glm4MoeDecoderLayer(a, i, method_for, dtype, backend, ops, self.tp)
