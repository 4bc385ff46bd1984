"""Configuration: frozen dataclasses, one per concern, validated at construction.

Components receive the sub-config they use (the cache manager gets `CacheConfig`, the scheduler
`SchedulerConfig`), never the whole tree. Field docstrings (the comments beside each field) are
the documentation of the matching CLI flags.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Literal

DTYPES = ("auto", "bfloat16", "float16", "float32")
GiB = 1 << 30


@dataclass(frozen=True)
class ModelConfig:
    model: str | None = None  # HF checkpoint directory; None = the bundled default model
    dtype: str = "auto"  # weights and activations: auto (bf16 on CPU), bfloat16, float32
    max_model_len: int | None = None  # prompt + output tokens; None = the model's own limit
    seed: int = 0  # seed of the engine's default sampling generator
    quantization: str | None = None  # weight format to quantize dense weights into on load
    attention_backend: str = "torch"  # registered paged-attention implementation

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16  # tokens per KV block
    kv_cache_memory: int | None = None  # bytes for K and V of all layers; None = derived
    enable_prefix_caching: bool = True  # reuse KV blocks of identical prompt prefixes
    max_kv_cache_memory: int = 2 * GiB  # cap on the derived size (max_model_len x max_num_seqs)

    def __post_init__(self):
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be positive bytes, got {self.kv_cache_memory}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64  # running sequences per step
    max_num_batched_tokens: int = 2048  # tokens per step (decodes first, then prefill chunks)
    enable_chunked_prefill: bool = True  # split long prompts across steps under the budget
    policy: Literal["fcfs", "priority"] = "fcfs"  # priority: lower value first, then arrival

    def __post_init__(self):
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"policy must be fcfs or priority, got {self.policy!r}")


@dataclass(frozen=True)
class ParallelConfig:
    num_threads: int | None = None  # torch intra-op threads; None = all cores of this process

    def __post_init__(self):
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def replace(self, **changes) -> EngineConfig:
        return dataclasses.replace(self, **changes)


def default_num_threads() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
