"""What a model's paged KV cache holds per token: the model says, the runner sizes and
allocates from it, and a KV transfer between workers compares it.

Every layer's cache is a tuple of `num_tensors` tensors of one shape, [slots, heads, width],
slot = block_id * block_size + offset:

  KEY_VALUE   K and V of every KV head: two tensors [slots, Hkv, D] (the Llama families).
  MLA_LATENT  multi-head latent attention (DeepSeek-V2/V3): one tensor [slots, 1, R + P] per
              layer, the token's compressed latent c_kv (R = kv_lora_rank) and its rotated
              key k_pe (P = qk_rope_head_dim) side by side. Attention reads it as one MQA
              head: keys the whole row, values its first R columns (kiln.models.layers.mla).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch


class CacheHolds(enum.Enum):
    KEY_VALUE = "key_value"
    MLA_LATENT = "mla_latent"


@dataclass(frozen=True)
class CacheLayout:
    """One layer's cache tensors: `num_tensors` of [slots, num_heads, head_dim] each."""

    holds: CacheHolds
    num_heads: int
    head_dim: int

    @classmethod
    def key_value(cls, num_kv_heads: int, head_dim: int) -> CacheLayout:
        return cls(CacheHolds.KEY_VALUE, num_kv_heads, head_dim)

    @classmethod
    def mla_latent(cls, kv_lora_rank: int, qk_rope_head_dim: int) -> CacheLayout:
        return cls(CacheHolds.MLA_LATENT, 1, kv_lora_rank + qk_rope_head_dim)

    @property
    def num_tensors(self) -> int:
        return 2 if self.holds is CacheHolds.KEY_VALUE else 1

    def bytes_per_token(self, num_layers: int, dtype: torch.dtype) -> int:
        """Cache bytes one token takes over all `num_layers` layers."""
        return num_layers * self.num_tensors * self.num_heads * self.head_dim * dtype.itemsize


def model_cache_layout(model, num_kv_heads: int, head_dim: int) -> CacheLayout:
    """The model's own layout where it states one (`cache_layout()`: MLA models), else K and
    V of `num_kv_heads` heads of `head_dim` (this rank's heads under tensor parallelism)."""
    own = getattr(model, "cache_layout", None)
    return own() if own is not None else CacheLayout.key_value(num_kv_heads, head_dim)
