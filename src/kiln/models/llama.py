"""The Llama family: Llama 2/3, Mistral, Qwen2 (q/k/v bias) and Qwen3 (q/k RMSNorm).

One decoder block, as in the papers: x + Attn(RMSNorm(x)), then h + MLP(RMSNorm(h)), with
rotary positions on q and k, grouped-query attention, and a SwiGLU MLP. Activations are a flat
batch of T tokens from any number of sequences; the paged KV cache and per-step attention
metadata are passed in explicitly. Parameter names follow the HF checkpoints except the fused
projections (`qkv_proj`, `gate_up_proj`), which the loader fills shard by shard.

Built with a `TensorParallel` other than SINGLE, a module holds one rank's part: its heads,
its columns of the MLP, its rows of the vocabulary (kiln.models.layers.parallel). Built with a
`PipelineStage`, it holds one stage's decoder layers (kiln.models.layers.pipeline): `embed`,
`run_layers` and `final_norm` are the stage-sized pieces of `forward`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from kiln.models.layers.attention import AttentionBackend, AttentionMetadata
from kiln.models.layers.linear import Linear, LinearMethod
from kiln.models.layers.norm import RMSNorm
from kiln.models.layers.ops import TorchOps
from kiln.models.layers.parallel import SINGLE, TensorParallel
from kiln.models.layers.pipeline import PipelineStage
from kiln.models.layers.rotary import RotaryEmbedding

if TYPE_CHECKING:
    from kiln.models.layers.moe import SparseMoeBlock

# HF checkpoint module name -> (fused kiln module, shard index)
PACKED_MODULES = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}

MethodFor = Callable[[str], LinearMethod | None]  # module prefix -> weight format (None = dense)


@dataclass(frozen=True)
class LlamaArch:
    """The shape of a Llama-family model, read from an HF config.json."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool

    @classmethod
    def from_hf(cls, cfg: dict, arch: str) -> LlamaArch:
        rope = cfg.get("rope_parameters") or {}
        scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default")
                                              != "default" else None)
        heads = cfg["num_attention_heads"]
        return cls(
            hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"], num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            vocab_size=cfg["vocab_size"], rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=cfg.get("rope_theta", rope.get("rope_theta", 10000.0)),
            rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            qkv_bias=arch == "Qwen2ForCausalLM" or cfg.get("attention_bias", False),
            qk_norm=arch == "Qwen3ForCausalLM")


class LlamaAttention(nn.Module):
    def __init__(self, a: LlamaArch, prefix: str, method_for: MethodFor, dtype, backend, ops,
                 tp: TensorParallel = SINGLE):
        super().__init__()
        heads = tp.heads(a.num_heads, a.num_kv_heads)  # this rank's (all of them: SINGLE)
        self.num_heads, self.num_kv_heads, self.head_dim = heads.q, heads.kv, a.head_dim
        q_size, kv_size = heads.q * a.head_dim, heads.kv * a.head_dim
        q_rows = heads.qkv_rows(a.head_dim)
        self.qkv_proj = Linear(a.hidden_size, (q_size, kv_size, kv_size), bias=a.qkv_bias,
                               dtype=dtype,
                               method=tp.column(method_for(f"{prefix}.qkv_proj"), q_rows))
        self.o_proj = Linear(q_size, a.hidden_size, dtype=dtype,
                             method=tp.row(method_for(f"{prefix}.o_proj"), q_rows[0]))
        if a.qk_norm:
            self.q_norm = RMSNorm(a.head_dim, a.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(a.head_dim, a.rms_norm_eps, dtype)
        self.qk_norm = a.qk_norm
        self.backend: AttentionBackend = backend
        self.ops: TorchOps = ops
        self.scale = a.head_dim ** -0.5

    def forward(self, x, positions, rotary: RotaryEmbedding, kv_cache,
                meta: AttentionMetadata):
        qkv = self.qkv_proj(x)  # [T, (Hq + 2 Hkv) * D]
        if self.qk_norm:  # Qwen3: RMSNorm over each q and k head, before the rotation
            q, k, v = self.ops.qk_norm_rotary_qkv(qkv, positions, rotary, self.q_norm.weight,
                                                  self.k_norm.weight, self.q_norm.eps,
                                                  self.num_heads, self.num_kv_heads)
        else:
            q, k, v = self.ops.rotary_qkv(qkv, positions, rotary, self.num_heads,
                                          self.num_kv_heads)
        return self.o_proj(self.backend.forward(q, k, v, kv_cache, meta, self.scale))


class LlamaMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), with gate and up fused into one matmul."""

    def __init__(self, a: LlamaArch, prefix: str, method_for: MethodFor, dtype, ops,
                 tp: TensorParallel = SINGLE):
        super().__init__()
        cols = tp.part(a.intermediate_size)  # this rank's share of the intermediate size
        size = cols.stop - cols.start
        self.gate_up_proj = Linear(a.hidden_size, [size] * 2, dtype=dtype,
                                   method=tp.column(method_for(f"{prefix}.gate_up_proj"),
                                                    (cols, cols)))
        self.down_proj = Linear(size, a.hidden_size, dtype=dtype,
                                method=tp.row(method_for(f"{prefix}.down_proj"), cols))
        self.ops = ops

    def forward(self, x):
        return self.down_proj(self.ops.silu_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block. The residual stream is carried separately so each norm can fuse the
    preceding residual add: (x, residual) -> (mlp_out, residual + attn_out)."""

    def __init__(self, a: LlamaArch, prefix: str, method_for: MethodFor, dtype, backend, ops,
                 tp: TensorParallel = SINGLE):
        super().__init__()
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps, dtype)
        self.self_attn = LlamaAttention(a, f"{prefix}.self_attn", method_for, dtype, backend,
                                        ops, tp)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps, dtype)
        self.add_feed_forward(a, prefix, method_for, dtype, ops, tp)
        self.ops = ops

    def add_feed_forward(self, a: LlamaArch, prefix: str, method_for: MethodFor, dtype,
                         ops, tp: TensorParallel = SINGLE) -> None:
        """Registers the block's feed-forward under its checkpoint name (a hook: the MoE
        families register their sparse block, kiln.models.mixtral and qwen_moe)."""
        self.mlp = LlamaMLP(a, f"{prefix}.mlp", method_for, dtype, ops, tp)

    def feed_forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.mlp(h)

    def dense_mlp(self) -> LlamaMLP | None:
        """The block's dense SwiGLU MLP, or None where its feed-forward is something else (a
        mixture of experts): the fused decoder stack runs only the former."""
        return self.mlp

    def sparse_moe(self) -> SparseMoeBlock | None:
        """The block's sparse mixture-of-experts feed-forward, or None (a dense MLP): the
        fused decoder stack runs the former where its router and experts allow."""
        return None

    def forward(self, x, residual, positions, rotary, kv_cache, meta):
        norm1, norm2, eps = self.input_layernorm, self.post_attention_layernorm, norm_eps(self)
        if residual is None:
            residual, h = x, self.ops.rms_norm(x, norm1.weight, eps)
        else:
            h, residual = self.ops.add_rms_norm(x, residual, norm1.weight, eps)
        h = self.self_attn(h, positions, rotary, kv_cache, meta)
        h, residual = self.ops.add_rms_norm(h, residual, norm2.weight, eps)
        return self.feed_forward(h), residual


def norm_eps(layer: LlamaDecoderLayer) -> float:
    return layer.input_layernorm.eps


class LlamaModel(nn.Module):
    def __init__(self, a: LlamaArch, method_for: MethodFor, dtype, backend, ops,
                 tp: TensorParallel = SINGLE,
                 make_layer: Callable[[int], nn.Module] | None = None,
                 stage: PipelineStage | None = None):
        super().__init__()
        stage = stage or PipelineStage.whole(a.num_layers)
        if stage.is_first or (stage.is_last and a.tie_word_embeddings):  # (a tied LM head's
            self.embed_tokens = tp.embedding(a.vocab_size, a.hidden_size, dtype)  # source)
        make_layer = make_layer or (lambda i: LlamaDecoderLayer(
            a, f"model.layers.{i}", method_for, dtype, backend, ops, tp))
        # other stages' layers are empty placeholders: parameter names stay the checkpoint's
        self.layers = nn.ModuleList(make_layer(i) if i in stage.layers else nn.Identity()
                                    for i in range(a.num_layers))
        if stage.is_last:
            self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps, dtype)


class LlamaForCausalLM(nn.Module):
    """forward(input_ids [T], positions [T]) -> hidden [T, H]; compute_logits -> [N, V]
    (with tensor parallelism: on rank 0; None on the others)."""

    packed_modules = PACKED_MODULES
    # whether a family's own layers (layer_maker) split over tensor-parallel ranks (the MoE
    # families: kiln.models.layers.expert_parallel)
    tensor_parallel_layers = False

    def __init__(self, a: LlamaArch, dtype: torch.dtype, backend: AttentionBackend,
                 method_for: MethodFor = lambda prefix: None, ops: TorchOps | None = None,
                 tp: TensorParallel = SINGLE, stage: PipelineStage | None = None):
        super().__init__()
        self.arch, self.tp = a, tp
        self.stage = stage or PipelineStage.whole(a.num_layers)
        self.ops = ops or TorchOps()
        make_layer = self.layer_maker(a, method_for, dtype, backend, self.ops)
        if make_layer is not None and tp.size > 1 and not self.tensor_parallel_layers:
            raise ValueError(f"tensor_parallel_size {tp.size}: {type(self).__name__} runs in one "
                             f"process only (its layers do not split over ranks); use 1")
        self.model = LlamaModel(a, method_for, dtype, backend, self.ops, tp, make_layer,
                                self.stage)
        self.rotary = self.make_rotary(a, dtype)
        # with tied embeddings the loader fills lm_head from embed_tokens (packed separately),
        # which already holds just this rank's rows of the vocabulary
        vocab = tp.vocab_rows(a.vocab_size)
        per_rank = tp.vocab_per_rank(a.vocab_size)
        rows = slice(0, per_rank) if a.tie_word_embeddings else vocab
        if self.stage.is_last:
            self.lm_head = Linear(a.hidden_size, per_rank, dtype=dtype,
                                  method=tp.column(method_for("lm_head"), (rows,)))

    def make_rotary(self, a: LlamaArch, dtype: torch.dtype) -> RotaryEmbedding:
        """The rotary tables, over whole heads (a hook: GLM-4.5 rotates part of each head)."""
        return RotaryEmbedding(a.head_dim, a.max_position_embeddings, a.rope_theta,
                               a.rope_scaling, dtype)

    def layer_maker(self, a: LlamaArch, method_for: MethodFor, dtype, backend,
                    ops) -> Callable[[int], nn.Module] | None:
        """Layer index -> decoder layer, for families whose layers differ (a hook; None:
        every layer a LlamaDecoderLayer)."""
        return None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                meta: AttentionMetadata) -> torch.Tensor:
        x, residual = self.run_layers(self.embed(input_ids), None, positions, kv_caches, meta)
        return self.final_norm(x, residual)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] -> [T, H] (the first stage)."""
        return self.model.embed_tokens(input_ids)

    def run_layers(self, x: torch.Tensor, residual: torch.Tensor | None,
                   positions: torch.Tensor, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                   meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """This stage's decoder layers (`kv_caches`: one per layer of the stage) over the
        residual stream: (x, residual) -> (x, residual), residual None before the first."""
        layers = [self.model.layers[i] for i in self.stage.layers]
        for layer, kv_cache in zip(layers, kv_caches, strict=True):
            x, residual = layer(x, residual, positions, self.rotary, kv_cache, meta)
        return x, residual

    def final_norm(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """The last residual add and the final RMSNorm: the hidden states [T, H] (the last
        stage)."""
        norm = self.model.norm
        return self.ops.add_rms_norm(x, residual, norm.weight, norm.eps)[0]

    def holds_tensor(self, name: str) -> bool:
        """Whether checkpoint tensor `name` belongs to this stage (the loader skips another
        stage's). A layer past the model's own is no stage's: it is held, so that the loader
        names it as a tensor the model does not run."""
        if name.startswith("model.layers."):
            index = int(name.split(".")[2])
            return index in self.stage.layers or index >= self.arch.num_layers
        if name.startswith("model.embed_tokens."):
            return hasattr(self.model, "embed_tokens")
        return self.stage.is_last or not name.startswith(("model.norm.", "lm_head."))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits [N, V] from the LM head's fp32 sums (never rounded to the model dtype)."""
        logits = self.lm_head.method.apply_fp32(self.lm_head, hidden)
        return self.tp.gather_logits(logits, self.arch.vocab_size)
