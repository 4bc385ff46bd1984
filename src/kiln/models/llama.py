"""The Llama family: Llama 2/3, Mistral, Qwen2 (q/k/v bias) and Qwen3 (q/k RMSNorm).

One decoder block, as in the papers: x + Attn(RMSNorm(x)), then h + MLP(RMSNorm(h)), with
rotary positions on q and k, grouped-query attention, and a SwiGLU MLP. Activations are a flat
batch of T tokens from any number of sequences; the paged KV cache and per-step attention
metadata are passed in explicitly. Parameter names follow the HF checkpoints except the fused
projections (`qkv_proj`, `gate_up_proj`), which the loader fills shard by shard.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from kiln.models.layers.linear import Linear, LinearMethod
from kiln.models.layers.norm import RMSNorm
from kiln.models.layers.ops import TorchOps
from kiln.models.layers.rotary import RotaryEmbedding
from kiln.runner.attention import AttentionBackend

log = logging.getLogger(__name__)

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
    def __init__(self, a: LlamaArch, prefix: str, method_for: MethodFor, dtype, backend, ops):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = a.num_heads, a.num_kv_heads, a.head_dim
        q_size, kv_size = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        self.split = (q_size, kv_size, kv_size)
        self.qkv_proj = Linear(a.hidden_size, self.split, bias=a.qkv_bias, dtype=dtype,
                               method=method_for(f"{prefix}.qkv_proj"))
        self.o_proj = Linear(q_size, a.hidden_size, dtype=dtype,
                             method=method_for(f"{prefix}.o_proj"))
        if a.qk_norm:
            self.q_norm = RMSNorm(a.head_dim, a.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(a.head_dim, a.rms_norm_eps, dtype)
        self.qk_norm = a.qk_norm
        self.backend: AttentionBackend = backend
        self.ops: TorchOps = ops
        self.scale = a.head_dim ** -0.5

    def forward(self, x, positions, rotary: RotaryEmbedding, kv_cache, meta):
        qkv = self.qkv_proj(x)
        if self.ops.name == "kernels" and not self.qk_norm:
            rotary.apply_inplace(qkv, positions, self.num_heads, self.num_kv_heads)
            q, k, v = self._heads(qkv)
        else:
            q, k, v = self._heads(qkv)
            if self.qk_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = self.ops.rotary(q, k, positions, rotary.cos, rotary.sin)
        return self.o_proj(self.backend.forward(q, k, v, kv_cache, meta, self.scale))

    def _heads(self, qkv):
        """Views [T, H, D] of the q, k and v parts of the fused projection's output."""
        q, k, v = qkv.split(self.split, dim=-1)
        return (q.view(-1, self.num_heads, self.head_dim),
                k.view(-1, self.num_kv_heads, self.head_dim),
                v.view(-1, self.num_kv_heads, self.head_dim))


class LlamaMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), with gate and up fused into one matmul."""

    def __init__(self, a: LlamaArch, prefix: str, method_for: MethodFor, dtype, ops):
        super().__init__()
        self.gate_up_proj = Linear(a.hidden_size, [a.intermediate_size] * 2, dtype=dtype,
                                   method=method_for(f"{prefix}.gate_up_proj"))
        self.down_proj = Linear(a.intermediate_size, a.hidden_size, dtype=dtype,
                                method=method_for(f"{prefix}.down_proj"))
        self.ops = ops

    def forward(self, x):
        return self.down_proj(self.ops.silu_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block. The residual stream is carried separately so each norm can fuse the
    preceding residual add: (x, residual) -> (mlp_out, residual + attn_out)."""

    def __init__(self, a: LlamaArch, prefix: str, method_for: MethodFor, dtype, backend, ops):
        super().__init__()
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps, dtype)
        self.self_attn = LlamaAttention(a, f"{prefix}.self_attn", method_for, dtype, backend,
                                        ops)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps, dtype)
        self.mlp = LlamaMLP(a, f"{prefix}.mlp", method_for, dtype, ops)
        self.ops = ops

    def forward(self, x, residual, positions, rotary, kv_cache, meta):
        norm1, norm2, eps = self.input_layernorm, self.post_attention_layernorm, norm_eps(self)
        if residual is None:
            residual, h = x, self.ops.rms_norm(x, norm1.weight, eps)
        else:
            h, residual = self.ops.add_rms_norm(x, residual, norm1.weight, eps)
        h = self.self_attn(h, positions, rotary, kv_cache, meta)
        h, residual = self.ops.add_rms_norm(h, residual, norm2.weight, eps)
        return self.mlp(h), residual


def norm_eps(layer: LlamaDecoderLayer) -> float:
    return layer.input_layernorm.eps


class LlamaModel(nn.Module):
    def __init__(self, a: LlamaArch, method_for: MethodFor, dtype, backend, ops):
        super().__init__()
        self.embed_tokens = nn.Embedding(a.vocab_size, a.hidden_size, dtype=dtype)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(a, f"model.layers.{i}", method_for, dtype, backend, ops)
            for i in range(a.num_layers))
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps, dtype)


class LlamaForCausalLM(nn.Module):
    """forward(input_ids [T], positions [T]) -> hidden [T, H]; compute_logits -> [N, V]."""

    packed_modules = PACKED_MODULES

    def __init__(self, a: LlamaArch, dtype: torch.dtype, backend: AttentionBackend,
                 method_for: MethodFor = lambda prefix: None, ops: TorchOps | None = None):
        super().__init__()
        self.arch = a
        self.ops = ops or TorchOps()
        self.model = LlamaModel(a, method_for, dtype, backend, self.ops)
        self.rotary = RotaryEmbedding(a.head_dim, a.max_position_embeddings, a.rope_theta,
                                      a.rope_scaling, dtype)
        # with tied embeddings the loader fills lm_head from embed_tokens (packed separately)
        self.lm_head = Linear(a.hidden_size, a.vocab_size, dtype=dtype,
                              method=method_for("lm_head"))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta) -> torch.Tensor:
        x, residual = self.model.embed_tokens(input_ids), None
        if self._stack_ready(meta):
            return fused_stack(self, x, positions, kv_caches, meta)
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            x, residual = layer(x, residual, positions, self.rotary, kv_cache, meta)
        norm = self.model.norm
        return self.ops.add_rms_norm(x, residual, norm.weight, norm.eps)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def _stack_ready(self, meta) -> bool:
        """Whether this step can run as one C++ call (`fused_stack`): the fast path's ops
        throughout, no hooks to honour (speculator heads, scoring and GPTQ attach them), and
        every chunk's attention within the C++ kernels."""
        if self.__dict__.get("_stack") is None:
            self._stack = stack_weights(self)
            if not self._stack and self.ops.name == "kernels":
                log.info("decoder layers run one call each (a layer is off the fused path: "
                         "see kiln.models.llama.stack_weights)")
        if not self._stack:
            return False
        if meta.long is not None and not self._stack["long_ok"]:
            return False
        if meta.num_tokens > self._stack["max_tokens"]:
            return False
        return not (global_hooks() or any(self._stack["hook_dicts"]))


def global_hooks() -> bool:
    from torch.nn.modules import module

    return bool(module._global_forward_hooks or module._global_forward_pre_hooks)


def stack_weights(model: LlamaForCausalLM) -> dict:
    """The per-layer tensors `kiln::llama_stack` takes, or {} when the model is not on the
    fast path throughout (reference ops, another attention backend, q/k norms, a linear with a
    bias or in a format other than oneDNN bf16, kiln's bf16-fp32 and weight-only int8)."""
    from kiln.runner.attention import CpuPagedAttention

    layers = list(model.model.layers)
    attn = [layer.self_attn for layer in layers]
    mlp = [layer.mlp for layer in layers]
    projections = {"qkv": [a.qkv_proj for a in attn], "o": [a.o_proj for a in attn],
                   "gate_up": [f.gate_up_proj for f in mlp], "down": [f.down_proj for f in mlp]}
    linears = [m for ms in projections.values() for m in ms]
    stored = [stack_linear_tensors(m) for m in linears]
    if (model.ops.name != "kernels" or model.arch.qk_norm or None in stored
            or not all(isinstance(a.backend, CpuPagedAttention) for a in attn)):
        return {}
    tensors = dict(zip(linears, stored, strict=True))
    out = {name: [tensors[m][0] for m in ms] for name, ms in projections.items()}
    int8 = any(t[1].numel() for t in stored)
    for name, ms in projections.items():  # empty lists: every layer bf16
        out[f"{name}_scale"] = [tensors[m][1] for m in ms] if int8 else []
    from kiln.kernels.bf16_mm import BF16_GEMM_MAX_TOKENS
    from kiln.kernels.quant_mm import INT8_GEMV_MAX_TOKENS
    from kiln.models.layers.cpu_bf16 import CpuBf16LinearMethod

    plain_bf16 = any(isinstance(m.method, CpuBf16LinearMethod) for m in linears)
    # int8_gemv and bf16_gemm serve only decode-sized steps; larger ones go layer by layer
    limits = [limit for limit, used in ((INT8_GEMV_MAX_TOKENS, int8),
                                        (BF16_GEMM_MAX_TOKENS, plain_bf16)) if used]
    return out | {
        "input_norm": [layer.input_layernorm.weight for layer in layers],
        "post_norm": [layer.post_attention_layernorm.weight for layer in layers],
        # the hook registries of every module the stack bypasses (the same dicts for the
        # model's lifetime: registering or removing a hook edits them in place), so the
        # per-step check is one any() over them
        "hook_dicts": [d for m in layers + attn + mlp + linears
                       for d in (m._forward_hooks, m._forward_pre_hooks)],
        "long_ok": (attn[0].backend.bf16_prefill and model.arch.head_dim in (64, 128)
                    and model.model.embed_tokens.weight.dtype == torch.bfloat16),
        "plain_bf16": plain_bf16,  # bf16 weights through bf16_gemm, not oneDNN-packed
        "max_tokens": min(limits, default=math.inf),  # the largest step the stack serves
    }


def stack_linear_tensors(m: Linear) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(weight, scale) of one linear as `kiln::llama_stack` reads it: a oneDNN-packed or a
    plain bf16 weight (`dense-bf16-fp32`) with an empty scale, or int8 weight-only rows with
    their scales; None otherwise."""
    from kiln.models.layers.cpu_bf16 import CpuBf16LinearMethod
    from kiln.models.layers.onednn import OneDNNLinearMethod

    if m.bias is not None:
        return None
    if isinstance(m.method, OneDNNLinearMethod) and hasattr(m, "packed_weight"):
        return m.packed_weight, _NO_SCALE
    if isinstance(m.method, CpuBf16LinearMethod) and m.weight.dtype == torch.bfloat16:
        return m.weight, _NO_SCALE
    try:
        from kiln.quant.linear import Int8LinearMethod
    except ImportError:  # pragma: no cover - kiln.quant ships with kiln
        return None
    if (isinstance(m.method, Int8LinearMethod) and not m.method.act_quant
            and m.weight.dtype == torch.int8):
        return m.weight, m.weight_scale
    return None


_NO_SCALE = torch.empty(0)


def fused_stack(model: LlamaForCausalLM, x, positions, kv_caches, meta) -> torch.Tensor:
    """Every decoder layer and the final norm in one call to `kiln::llama_stack`: the same
    kernels in the same order as the per-layer path, so the same result to the bit."""
    w, a = model._stack, model.arch
    norm = model.model.norm
    return torch.ops.kiln.llama_stack(
        x, positions, w["input_norm"], w["qkv"], w["o"], w["post_norm"], w["gate_up"],
        w["down"], w["qkv_scale"], w["o_scale"], w["gate_up_scale"], w["down_scale"],
        norm.weight, model.rotary.cos32, model.rotary.sin32,
        [k for k, _ in kv_caches], [v for _, v in kv_caches], *stack_attention_args(meta),
        a.head_dim ** -0.5, norm.eps, a.num_heads, a.num_kv_heads, a.head_dim,
        w["plain_bf16"])


def stack_attention_args(meta) -> tuple:
    """`kiln::llama_stack`'s attention arguments from the cpu backend's metadata: the slot
    mapping, the short queries' layout (with its tree bits), the long ones', the block size."""
    short, long = meta.short, meta.long
    none4 = (None, None, None, None)
    short_args = ((short.block_table, short.query_start, short.query_lens, short.context_lens,
                   short.tree_mask) if short is not None else (*none4, None))
    long_args = ((long.block_table, long.query_start, long.query_lens, long.context_lens)
                 if long is not None else none4)
    return (meta.slot_mapping, *short_args, *long_args, meta.block_size)
