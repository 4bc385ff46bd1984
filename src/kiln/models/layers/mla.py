"""Multi-head latent attention (DeepSeek-V2, arXiv 2405.04434 §2.1; DeepSeek-V3).

Every token's keys and values come from one compressed latent c_kv (kv_lora_rank R wide) and
one rotated key k_pe shared by all heads (qk_rope_head_dim P wide):

  q        = q_b_proj(RMSNorm(q_a_proj(x)))   (or q_proj(x) when q_lora_rank is null)
  q_nope, q_pe = split(q per head, [N, P])    N = qk_nope_head_dim
  c_kv, k_pe   = split(kv_a_proj_with_mqa(x), [R, P]);  c_kv = RMSNorm(c_kv)
  q_pe, k_pe   = rope(q_pe), rope(k_pe)
  k_nope_h = W_UK_h c_kv,  v_h = W_UV_h c_kv   (kv_b_proj holds W_UK and W_UV per head)

The cache keeps only c_kv and k_pe, R + P numbers per token and layer
(kiln.models.layers.kv_layout MLA_LATENT). Attention runs in the absorbed form, where W_UK
moves onto the query and W_UV after the softmax:

  score_h(t, s) = (W_UK_h^T q_nope_h) . c_kv_s + q_pe_h . k_pe_s
  out_h        = W_UV_h (sum_s softmax_s * c_kv_s)

so it is multi-query attention over one head R + P wide whose values are the first R columns
of the keys (`LatentAttentionBackend.forward_latent`), for prefill and decode alike.

Under tensor parallelism (as vLLM splits MLA) a rank holds H / T heads: their rows of q_proj
(or q_b_proj) and of kv_b_proj, and their input columns of o_proj, whose all-reduce sums the
heads' outputs. Everything before the heads split -- q_a_proj and its norm, kv_a_proj_with_mqa,
kv_a_layernorm, the rope key -- is computed whole on every rank, so every rank caches the same
latent: MLA's cache does not shrink with T (data-parallel attention is how it does).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from kiln.models.layers.attention import AttentionMetadata
from kiln.models.layers.linear import Linear
from kiln.models.layers.norm import RMSNorm
from kiln.models.layers.parallel import SINGLE, TensorParallel

SUPPORTED_ROPE_TYPES = ("default", "yarn")


class LatentAttentionBackend(Protocol):
    def forward_latent(self, q: torch.Tensor, kv: torch.Tensor, kv_cache: tuple[torch.Tensor],
                       meta: AttentionMetadata, scale: float, value_dim: int) -> torch.Tensor:
        """q: [T, H, R + P], kv: [T, 1, R + P] -> [T, H * value_dim]; writes kv into the
        layer's one cache tensor, then attends with values = the first value_dim columns."""
        ...


@dataclass(frozen=True)
class DeepseekRope:
    """DeepSeek's rotary embedding on the P rope dimensions: default or YaRN frequencies."""

    dim: int  # P = qk_rope_head_dim
    theta: float
    interleaved: bool  # rotate (x0, x1), (x2, x3)... pairs (rope_interleave) or halves
    rope_type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    @classmethod
    def from_hf(cls, cfg: dict, dim: int) -> DeepseekRope:
        """From transformers 5's `rope_parameters` or an older `rope_scaling` + `rope_theta`."""
        p = dict(cfg.get("rope_scaling") or cfg.get("rope_parameters") or {})
        rope_type = p.get("rope_type", p.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"config.json rope type {rope_type!r} is not supported for MLA; "
                             f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
        theta = p.get("rope_theta", cfg.get("rope_theta", 10000.0))
        interleaved = bool(cfg.get("rope_interleave", True))
        if rope_type == "default":
            return cls(dim, theta, interleaved)
        max_pos = cfg.get("max_position_embeddings", 4096)
        original = p.get("original_max_position_embeddings", max_pos)
        return cls(dim, theta, interleaved, rope_type, p.get("factor") or max_pos / original,
                   original, p.get("beta_fast") or 32.0, p.get("beta_slow") or 1.0,
                   p.get("mscale"), p.get("mscale_all_dim"), p.get("attention_factor"),
                   p.get("truncate", True))

    def inverse_frequencies(self) -> torch.Tensor:
        """[P / 2] frequencies (YaRN: blended between interpolated and original)."""
        exponents = torch.arange(0, self.dim, 2, dtype=torch.float) / self.dim
        if self.rope_type == "default":
            return 1.0 / (self.theta ** exponents)
        pos_freqs = self.theta ** exponents
        low, high = self._correction_range()
        ramp = (torch.arange(self.dim // 2, dtype=torch.float32) - low) / (
            high - low if high != low else 0.001)
        extrapolation = 1 - ramp.clamp(0, 1)
        return (1.0 / (self.factor * pos_freqs)) * (1 - extrapolation) + (
            1.0 / pos_freqs) * extrapolation

    def _correction_range(self) -> tuple[float, float]:
        """YaRN's dimensions between which frequencies blend (the paper's alpha, beta)."""
        def dim_of(rotations: float) -> float:
            return (self.dim * math.log(self.original_max_position_embeddings
                                        / (rotations * 2 * math.pi))) / (2 * math.log(self.theta))
        low, high = dim_of(self.beta_fast), dim_of(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        return max(low, 0), min(high, self.dim - 1)

    def cos_sin_scale(self) -> float:
        """YaRN's factor on cos and sin (its attention temperature on the rope dimensions)."""
        if self.rope_type == "default":
            return 1.0
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor,
                                                                       self.mscale_all_dim)
        return yarn_mscale(self.factor)

    def softmax_scale(self, qk_head_dim: int) -> float:
        """1 / sqrt(N + P), times mscale(mscale_all_dim)^2 under YaRN (DeepSeek scales the
        whole score, not only its rope part)."""
        scale = qk_head_dim ** -0.5
        if self.rope_type != "default" and self.mscale_all_dim:
            mscale = yarn_mscale(self.factor, self.mscale_all_dim)
            scale = scale * mscale * mscale  # HF's order of rounding
        return scale


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


class RopeTables(nn.Module):
    """cos/sin [max_pos, P / 2] in the activation dtype, rounded once from fp32 as HF does."""

    def __init__(self, rope: DeepseekRope, max_positions: int, dtype: torch.dtype):
        super().__init__()
        positions = torch.arange(max_positions, dtype=torch.int64).float()
        freqs = torch.outer(positions, rope.inverse_frequencies())
        scale = rope.cos_sin_scale()
        self.register_buffer("cos", (freqs.cos() * scale).to(dtype), persistent=False)
        self.register_buffer("sin", (freqs.sin() * scale).to(dtype), persistent=False)
        self.interleaved = rope.interleaved

    def rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [T, heads, P] -> rotated, laid out as halves [x1', x2'] (what HF's interleaved
        rope returns too: q and k agree, so their dot product is the rotated one)."""
        c, s = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
        x1, x2 = (x[..., 0::2], x[..., 1::2]) if self.interleaved else x.chunk(2, dim=-1)
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


@dataclass(frozen=True)
class MlaShape:
    """The attention shape of an MLA model, read from its HF config."""

    hidden_size: int
    num_heads: int  # H
    q_lora_rank: int | None  # None: q_proj straight from x
    kv_lora_rank: int  # R
    qk_nope_head_dim: int  # N
    qk_rope_head_dim: int  # P
    v_head_dim: int
    attention_bias: bool
    rms_norm_eps: float

    @classmethod
    def from_hf(cls, cfg: dict) -> MlaShape:
        return cls(cfg["hidden_size"], cfg["num_attention_heads"], cfg.get("q_lora_rank"),
                   cfg["kv_lora_rank"], cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"],
                   cfg["v_head_dim"], bool(cfg.get("attention_bias", False)),
                   cfg.get("rms_norm_eps", 1e-6))

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


class LatentUpProjection(nn.Module):
    """HF's kv_b_proj, [H * (N + V), R]: per head, W_UK's N rows then W_UV's V rows. Read as
    matrices by the absorbed form, never applied as a linear, so it is a plain parameter in
    the model dtype (not a `Linear`: no weight format or quantizer touches it). Holds the
    rows of `heads` only (a tensor-parallel rank's heads; one process: all of them)."""

    def __init__(self, s: MlaShape, dtype: torch.dtype, heads: slice):
        super().__init__()
        self.shape, self.heads = s, heads
        self.num_heads = heads.stop - heads.start
        rows = self.num_heads * self.rows_per_head
        self.weight = nn.Parameter(torch.empty(rows, s.kv_lora_rank, dtype=dtype, device="cpu"),
                                   requires_grad=False)

    @property
    def rows_per_head(self) -> int:
        return self.shape.qk_nope_head_dim + self.shape.v_head_dim

    def load_checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> None:
        """The loader's hook: keep this module's heads' rows of the checkpoint's kv_b_proj."""
        s = self.shape
        whole = (s.num_heads * self.rows_per_head, s.kv_lora_rank)
        if name != "weight" or tuple(tensor.shape) != whole:
            raise ValueError(f"kv_b_proj: checkpoint tensor {name!r} {tuple(tensor.shape)}, "
                             f"expected weight {whole}")
        per = self.rows_per_head
        with torch.no_grad():
            self.weight.copy_(tensor[self.heads.start * per:self.heads.stop * per])

    def per_head(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [H, N, R] and W_UV [H, V, R] (views; H: this module's heads)."""
        s = self.shape
        w = self.weight.view(self.num_heads, self.rows_per_head, s.kv_lora_rank)
        return w[:, :s.qk_nope_head_dim], w[:, s.qk_nope_head_dim:]


class MultiHeadLatentAttention(nn.Module):
    """forward(x [T, hidden], positions [T]) -> [T, hidden], writing c_kv and k_pe to the
    layer's cache. HF's module names."""

    def __init__(self, s: MlaShape, prefix: str, method_for, dtype: torch.dtype,
                 backend: LatentAttentionBackend, scale: float, tp: TensorParallel = SINGLE):
        super().__init__()
        self.shape, self.backend, self.scale = s, backend, scale
        heads = tp.part(s.num_heads)  # this rank's heads (H / T; one process: all)
        self.num_heads = heads.stop - heads.start
        q_rows = slice(heads.start * s.qk_head_dim, heads.stop * s.qk_head_dim)
        out_cols = slice(heads.start * s.v_head_dim, heads.stop * s.v_head_dim)
        heads_qk = self.num_heads * s.qk_head_dim
        if s.q_lora_rank is None:
            self.q_proj = Linear(s.hidden_size, heads_qk, dtype=dtype,
                                 method=tp.column(method_for(f"{prefix}.q_proj"), (q_rows,)))
        else:  # the low-rank query is replicated; its up-projection split by heads
            self.q_a_proj = Linear(s.hidden_size, s.q_lora_rank, bias=s.attention_bias,
                                   dtype=dtype, method=method_for(f"{prefix}.q_a_proj"))
            self.q_a_layernorm = RMSNorm(s.q_lora_rank, s.rms_norm_eps, dtype)
            self.q_b_proj = Linear(s.q_lora_rank, heads_qk, dtype=dtype,
                                   method=tp.column(method_for(f"{prefix}.q_b_proj"), (q_rows,)))
        # the latent and the rope key: whole on every rank (each rank caches all of it)
        self.kv_a_proj_with_mqa = Linear(s.hidden_size, s.kv_lora_rank + s.qk_rope_head_dim,
                                         bias=s.attention_bias, dtype=dtype,
                                         method=method_for(f"{prefix}.kv_a_proj_with_mqa"))
        self.kv_a_layernorm = RMSNorm(s.kv_lora_rank, s.rms_norm_eps, dtype)
        self.kv_b_proj = LatentUpProjection(s, dtype, heads)
        self.o_proj = Linear(self.num_heads * s.v_head_dim, s.hidden_size,
                             bias=s.attention_bias, dtype=dtype,
                             method=tp.row(method_for(f"{prefix}.o_proj"), out_cols))

    def queries(self, x: torch.Tensor) -> torch.Tensor:
        if self.shape.q_lora_rank is None:
            return self.q_proj(x)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RopeTables,
                kv_cache: tuple[torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        s, h, tokens = self.shape, self.num_heads, x.shape[0]  # h: this rank's heads
        q = self.queries(x).view(tokens, h, s.qk_head_dim)
        q_nope, q_pe = q.split((s.qk_nope_head_dim, s.qk_rope_head_dim), dim=-1)
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split((s.kv_lora_rank, s.qk_rope_head_dim),
                                                      dim=-1)
        c_kv = self.kv_a_layernorm(c_kv)
        q_pe = rope.rotate(q_pe, positions)
        k_pe = rope.rotate(k_pe.unsqueeze(1), positions)  # [T, 1, P]
        w_uk, w_uv = self.kv_b_proj.per_head()
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [T, H, R]
        query = torch.cat((q_latent, q_pe), dim=-1)  # [T, H, R + P]
        kv = torch.cat((c_kv.unsqueeze(1), k_pe), dim=-1)  # [T, 1, R + P]
        latent_out = self.backend.forward_latent(query, kv, kv_cache, meta, self.scale,
                                                 s.kv_lora_rank)  # [T, H * R]
        latent_out = latent_out.view(tokens, h, s.kv_lora_rank).transpose(0, 1)
        out = torch.bmm(latent_out, w_uv.transpose(1, 2))  # [H, T, V]
        return self.o_proj(out.transpose(0, 1).reshape(tokens, h * s.v_head_dim))
