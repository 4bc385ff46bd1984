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
    attention_backend: str = "auto"  # auto (cpu kernels where they build), torch, cpu
    linear_backend: str = "auto"  # dense matmuls: auto (oneDNN prepacked for bf16), torch
    kernels: str = "auto"  # fused C++ CPU ops: auto (where they build), torch (reference), cpp

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.kernels not in ("auto", "torch", "cpp"):
            raise ValueError(f"kernels must be auto, torch or cpp, got {self.kernels!r}")
        if self.linear_backend not in ("auto", "torch", "onednn"):
            raise ValueError(f"linear_backend must be auto, torch or onednn, "
                             f"got {self.linear_backend!r}")
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


# -- serving (kiln serve) ---------------------------------------------------------------------

MiB = 1 << 20


@dataclass(frozen=True)
class WorkerConfig:
    """What one engine worker process needs: its engine, where the gateway is, how often to
    report. Sent to a spawned worker as JSON on its command line."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    gateway_address: str = ""  # ZMQ endpoint of the gateway's ROUTER socket to connect to
    worker_id: str = "worker-0"  # ZMQ identity prefix; unique among one gateway's workers
    heartbeat_interval_s: float = 0.5  # a heartbeat at least this often, idle or stepping
    parent_pid: int | None = None  # exit when this process is gone (workers kiln serve spawns)

    def __post_init__(self):
        if self.heartbeat_interval_s <= 0:
            raise ValueError(f"heartbeat_interval_s must be > 0, got {self.heartbeat_interval_s}")
        if not self.worker_id or "." in self.worker_id:
            raise ValueError(f"worker_id must be non-empty without '.', got {self.worker_id!r}")


@dataclass(frozen=True)
class ServeConfig:
    """The HTTP gateway: where it listens, who may call it, what it admits, how it supervises
    its worker and shuts down. Each field is a `kiln serve` flag of the same name."""

    host: str = "127.0.0.1"  # interface to listen on
    port: int = 8000  # TCP port to listen on
    api_keys: tuple[str, ...] = ()  # when set, every route but /health needs a Bearer key
    served_model_name: str | None = None  # the `model` clients send; None = model dir name
    pricing_file: str | None = None  # JSON/TOML price table by model name; None = built-in
    max_n: int = 16  # cap on `n` (choices per prompt)
    max_top_logprobs: int = 20  # cap on `top_logprobs` / `logprobs`
    max_body_bytes: int = 8 * MiB  # larger request bodies get 413
    admission_queue_size: int = 256  # sequences that may wait beyond max_num_seqs; then 429
    shutdown_timeout_s: float = 30.0  # SIGTERM: drain this long, then abort the rest
    restart_worker: bool = True  # restart a dead or stuck worker (--no-restart: stay down)
    heartbeat_timeout_s: float = 30.0  # no word from the worker this long = stuck
    worker_start_timeout_s: float = 600.0  # loading the model may take this long

    def __post_init__(self):
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if any(not k for k in self.api_keys):
            raise ValueError("API keys must be non-empty")
        _positive(self, "max_n", "max_body_bytes", "heartbeat_timeout_s",
                  "worker_start_timeout_s")
        if not 0 <= self.max_top_logprobs <= 20:
            raise ValueError(f"max_top_logprobs must be in [0, 20], got {self.max_top_logprobs}")
        if self.admission_queue_size < 0 or self.shutdown_timeout_s < 0:
            raise ValueError("admission_queue_size and shutdown_timeout_s must be >= 0")


def _positive(config: object, *names: str) -> None:
    for name in names:
        value = getattr(config, name)
        if value <= 0:
            raise ValueError(f"{name} must be > 0, got {value}")
