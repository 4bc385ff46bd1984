"""DeepSeek-V3 (arXiv 2412.19437): pre-norm blocks of multi-head latent attention and a
feed-forward, x + MLA(RMSNorm(x)) then h + FFN(RMSNorm(h)).

Attention is MLA (kiln.models.layers.mla): the paged KV cache holds one compressed latent and
one rotated key per token and layer, not K and V per head (`cache_layout`, `kv_footprint`).
The first `first_k_dense_replace` blocks have a dense SwiGLU MLP; the later ones DeepSeek's
mixture of experts (sigmoid router with grouped top-k and a score-correction bias, shared
experts), which `sparse_feed_forward` builds. HF's parameter names; gate and up fused.

Built with a `TensorParallel` other than SINGLE, a rank holds H / T attention heads (the
latent replicated: kiln.models.layers.mla), its columns of the dense MLPs and its part of each
mixture of experts (kiln.models.layers.expert_parallel), and its rows of the vocabulary, as
the Llama families split (kiln.models.layers.parallel).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from kiln.models.layers.expert_parallel import expert_shard, experts_elsewhere
from kiln.models.layers.kv_layout import CacheLayout
from kiln.models.layers.linear import Linear, LinearMethod
from kiln.models.layers.mla import DeepseekRope, MlaShape, MultiHeadLatentAttention, RopeTables
from kiln.models.layers.moe import SparseMoeBlock
from kiln.models.layers.moe_config import MoeShape, deepseek_moe_shape
from kiln.models.layers.moe_router import UnsupportedVariant
from kiln.models.layers.norm import RMSNorm
from kiln.models.layers.ops import TorchOps
from kiln.models.layers.parallel import SINGLE, TensorParallel
from kiln.models.llama import LlamaMLP

PACKED_MODULES = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

MethodFor = Callable[[str], LinearMethod | None]


@dataclass(frozen=True)
class DeepseekV3Arch:
    """The shape of a DeepSeek-V3 model, read from an HF config.json."""

    hidden_size: int
    intermediate_size: int  # the dense layers' MLP
    num_layers: int
    vocab_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    mla: MlaShape
    rope: DeepseekRope
    first_k_dense_replace: int  # layers [0, k) dense, the rest mixtures of experts
    moe: MoeShape | None  # the sparse layers' block (None: every layer dense)
    mtp_layers: int  # num_nextn_predict_layers: checkpoint layers after the last, not run

    @classmethod
    def from_hf(cls, cfg: dict, arch: str) -> DeepseekV3Arch:
        check_variant(cfg)
        mla = MlaShape.from_hf(cfg)
        num_layers, dense = cfg["num_hidden_layers"], cfg.get("first_k_dense_replace", 3)
        return cls(
            hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"], vocab_size=cfg["vocab_size"],
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False), mla=mla,
            rope=DeepseekRope.from_hf(cfg, mla.qk_rope_head_dim),
            first_k_dense_replace=dense,
            moe=deepseek_moe_shape(cfg) if dense < num_layers else None,
            mtp_layers=cfg.get("num_nextn_predict_layers") or 0)

    # what the runner reads of any model's attention: MLA caches one head R + P wide
    @property
    def num_heads(self) -> int:
        return self.mla.num_heads

    @property
    def num_kv_heads(self) -> int:
        return 1

    @property
    def head_dim(self) -> int:
        return self.mla.kv_lora_rank + self.mla.qk_rope_head_dim

    def row_parallel_inputs(self) -> dict[str, int]:
        """Each row-parallel projection's inputs (the runner checks their weight formats
        split over the ranks): o_proj reads V per head, not the cache's R + P."""
        return {"o_proj": self.mla.num_heads * self.mla.v_head_dim,
                "down_proj": self.intermediate_size}


def check_tensor_parallel_heads(a: DeepseekV3Arch, size: int) -> None:
    """ValueError naming the numbers unless `size` ranks split the attention heads evenly
    (the runner checks this, and the MLPs' and experts' splits, before any rank starts)."""
    if a.mla.num_heads % size:
        raise ValueError(f"tensor_parallel_size {size} does not divide DeepSeek-V3's "
                         f"{a.mla.num_heads} attention heads (num_attention_heads)")


def check_variant(cfg: dict) -> None:
    """Raise UnsupportedVariant naming a config entry kiln's DeepSeek-V3 would compute wrong:
    another activation, or DeepSeek sparse attention's indexer (V3.2's `index_*` fields)."""
    if cfg.get("hidden_act", "silu") != "silu":
        raise UnsupportedVariant("hidden_act", f"{cfg['hidden_act']!r}; kiln's DeepSeek-V3 "
                                 f"runs 'silu'")
    for field in cfg:
        if field.startswith("index_"):
            raise UnsupportedVariant(field, "DeepSeek sparse attention's indexer is not "
                                     "supported; kiln runs dense multi-head latent attention")


@dataclass(frozen=True)
class KVFootprint:
    """KV cache bytes per token (all layers) of an MLA model, and of the same model with
    plain multi-head attention caching K (N + P) and V (v_head_dim) for every head."""

    mla_bytes_per_token: int
    plain_bytes_per_token: int

    @property
    def ratio(self) -> float:
        return self.plain_bytes_per_token / self.mla_bytes_per_token


def kv_footprint(a: DeepseekV3Arch, dtype: torch.dtype) -> KVFootprint:
    m = a.mla
    plain = a.num_layers * m.num_heads * (m.qk_head_dim + m.v_head_dim) * dtype.itemsize
    return KVFootprint(mla_cache_layout(a).bytes_per_token(a.num_layers, dtype), plain)


def mla_cache_layout(a: DeepseekV3Arch) -> CacheLayout:
    return CacheLayout.mla_latent(a.mla.kv_lora_rank, a.mla.qk_rope_head_dim)


def sparse_feed_forward(a: DeepseekV3Arch, index: int, method_for: MethodFor, dtype,
                        ops: TorchOps, tp: TensorParallel = SINGLE) -> nn.Module:
    """Layer `index`'s mixture of experts: DeepSeek's sigmoid router with the bias-corrected
    grouped top-k, and its shared experts (kiln.models.layers.moe); this rank's experts or
    columns of them under tensor parallelism, its experts under data-parallel attention
    (kiln.models.layers.expert_parallel)."""
    assert a.moe is not None
    shard = expert_shard(tp, index, a.moe.router.num_experts)
    return SparseMoeBlock(a.moe, f"model.layers.{index}.mlp", method_for, dtype, ops, shard,
                          index)


class DeepseekV3DecoderLayer(nn.Module):
    """(x, residual) -> (ffn_out, residual + attn_out), each norm fusing the residual add."""

    def __init__(self, a: DeepseekV3Arch, index: int, method_for: MethodFor, dtype, backend,
                 ops: TorchOps, tp: TensorParallel = SINGLE):
        super().__init__()
        prefix = f"model.layers.{index}"
        self.input_layernorm = _norm(a, dtype)
        self.self_attn = MultiHeadLatentAttention(a.mla, f"{prefix}.self_attn", method_for,
                                                  dtype, backend,
                                                  a.rope.softmax_scale(a.mla.qk_head_dim), tp)
        self.post_attention_layernorm = _norm(a, dtype)
        if index < a.first_k_dense_replace:
            self.mlp = LlamaMLP(a, f"{prefix}.mlp", method_for, dtype, ops, tp)
        else:
            self.mlp = sparse_feed_forward(a, index, method_for, dtype, ops, tp)
        self.ops = ops

    def dense_mlp(self) -> None:
        """None: the fused decoder stack (kiln.runner.fused_stack) runs Llama's attention
        only, so MLA blocks stay on the per-layer path."""
        return None

    def sparse_moe(self) -> None:
        return None  # (as dense_mlp)

    def forward(self, x, residual, positions, rope: RopeTables, kv_cache, meta):
        eps = self.input_layernorm.eps
        if residual is None:
            residual, h = x, self.ops.rms_norm(x, self.input_layernorm.weight, eps)
        else:
            h, residual = self.ops.add_rms_norm(x, residual, self.input_layernorm.weight, eps)
        h = self.self_attn(h, positions, rope, kv_cache, meta)
        h, residual = self.ops.add_rms_norm(h, residual, self.post_attention_layernorm.weight,
                                            eps)
        return self.mlp(h), residual


def _norm(a: DeepseekV3Arch, dtype) -> RMSNorm:
    return RMSNorm(a.hidden_size, a.rms_norm_eps, dtype)


class DeepseekV3Model(nn.Module):
    def __init__(self, a: DeepseekV3Arch, method_for: MethodFor, dtype, backend, ops,
                 tp: TensorParallel = SINGLE):
        super().__init__()
        self.embed_tokens = tp.embedding(a.vocab_size, a.hidden_size, dtype)
        self.layers = nn.ModuleList(
            DeepseekV3DecoderLayer(a, i, method_for, dtype, backend, ops, tp)
            for i in range(a.num_layers))
        self.norm = _norm(a, dtype)


class DeepseekV3ForCausalLM(nn.Module):
    """forward(input_ids [T], positions [T]) -> hidden [T, H]; compute_logits -> [N, V]
    (with tensor parallelism: on rank 0; None on the others)."""

    packed_modules = PACKED_MODULES

    def __init__(self, a: DeepseekV3Arch, dtype: torch.dtype, backend,
                 method_for: MethodFor = lambda prefix: None, ops: TorchOps | None = None,
                 tp: TensorParallel = SINGLE):
        super().__init__()
        if not hasattr(backend, "forward_latent"):
            raise ValueError(f"attention backend {type(backend).__name__} has no multi-head "
                             f"latent attention; DeepSeek-V3 runs on the torch or cpu backend")
        check_tensor_parallel_heads(a, tp.size)
        self.arch, self.tp, self.ops = a, tp, ops or TorchOps()
        self.model = DeepseekV3Model(a, method_for, dtype, backend, self.ops, tp)
        self.rope = RopeTables(a.rope, a.max_position_embeddings, dtype)
        # with tied embeddings the loader fills lm_head from this rank's embedding rows
        per_rank = tp.vocab_per_rank(a.vocab_size)
        rows = slice(0, per_rank) if a.tie_word_embeddings else tp.vocab_rows(a.vocab_size)
        self.lm_head = Linear(a.hidden_size, per_rank, dtype=dtype,
                              method=tp.column(method_for("lm_head"), (rows,)))
        # multi-token-prediction layers follow the decoder's in the checkpoint (not run), and
        # under expert parallelism other ranks' experts
        self.unused_checkpoint_prefixes = tuple(
            f"model.layers.{i}." for i in range(a.num_layers, a.num_layers + a.mtp_layers)
        ) + experts_elsewhere(self)

    def cache_layout(self) -> CacheLayout:
        """What each layer's KV cache holds: c_kv and k_pe (kiln.models.layers.kv_layout)."""
        return mla_cache_layout(self.arch)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor]], meta) -> torch.Tensor:
        x, residual = self.model.embed_tokens(input_ids), None
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            x, residual = layer(x, residual, positions, self.rope, kv_cache, meta)
        norm = self.model.norm
        return self.ops.add_rms_norm(x, residual, norm.weight, norm.eps)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits [N, V] from the LM head's fp32 sums (rank 0's; None on the others)."""
        logits = self.lm_head.method.apply_fp32(self.lm_head, hidden)
        return self.tp.gather_logits(logits, self.arch.vocab_size)
