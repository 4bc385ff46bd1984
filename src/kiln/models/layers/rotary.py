"""Rotary position embeddings (rotate-half layout, as HF Llama/Qwen) with precomputed tables.

Scaling types: default, `linear` (positions divided by a factor) and `llama3` (low
frequencies slowed, high frequencies kept, a smooth ramp between).
"""

from __future__ import annotations

import math

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def inverse_frequencies(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """[head_dim / 2] angular frequencies, after the checkpoint's rope scaling."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (theta ** exponents)
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope scaling {rope_type!r} is not supported; "
                         f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        return _llama3_frequencies(inv_freq, scaling)
    return inv_freq


def _llama3_frequencies(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables [max_pos, D] (built on the CPU, moved with the model);
    applied by ModelOps.rotary (reference) or `apply_inplace` (fused kernel)."""

    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 scaling: dict | None = None, dtype: torch.dtype = torch.float32):
        super().__init__()
        inv_freq = inverse_frequencies(head_dim, theta, scaling)
        positions = torch.arange(max_positions, dtype=torch.int64, device="cpu").float()
        freqs = torch.outer(positions, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
        self.register_buffer("cos", emb.cos().to(dtype), persistent=False)
        self.register_buffer("sin", emb.sin().to(dtype), persistent=False)
        self.register_buffer("cos32", emb.cos(), persistent=False)  # for the fused kernel
        self.register_buffer("sin32", emb.sin(), persistent=False)

    def apply_inplace(self, qkv: torch.Tensor, positions: torch.Tensor, num_q_heads: int,
                      num_kv_heads: int) -> None:
        """Rotate the q and k heads inside the fused qkv output [T, (Hq + 2 Hkv) * D] with
        the C++ kernel (fp32 tables, one rounding)."""
        head_dim = self.cos32.shape[-1]
        torch.ops.kiln.rotary_inplace(qkv, positions, self.cos32, self.sin32, num_q_heads,
                                      num_kv_heads, head_dim)
