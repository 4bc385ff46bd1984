"""Configuration: frozen dataclasses, one per concern, validated at construction.

Components receive the sub-config they use (the cache manager gets `CacheConfig`, the scheduler
`SchedulerConfig`), never the whole tree. Each field documents itself with `metadata=doc(...)`:
that text is the help of its command-line flag (kiln.config_cli makes `kiln serve`'s and `kiln
worker`'s flags from these fields) and the reference for `LLM(**settings)` (`engine_config_from`).
A `Literal` annotation lists a field's choices; `check_choices`, which every `__post_init__`
calls first, enforces them, and the command line offers them.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import os
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from kiln.config_fields import check_choices, doc
from kiln.config_parallel import ParallelConfig
from kiln.config_speculative import SpeculativeConfig

GiB = 1 << 30


Dtype = Literal["auto", "bfloat16", "float16", "float32"]
DTYPES = typing.get_args(Dtype)


@dataclass(frozen=True)
class ModelConfig:
    model: str | None = field(default=None, metadata=doc(
        "HF checkpoint directory", none_means="the bundled default model"))
    device: Literal["auto", "cpu", "cuda"] = field(default="auto", metadata=doc(
        "where the model, KV cache and batch run; auto: cuda when torch sees a GPU (unless "
        "CPU-only kernels are named), else cpu"))
    dtype: Dtype = field(default="auto", metadata=doc(
        "weights and activations; auto: bfloat16 (on CPU and GPU)"))
    max_model_len: int | None = field(default=None, metadata=doc(
        "prompt + output tokens", none_means="the model's own limit"))
    seed: int = field(default=0, metadata=doc("seed of the engine's default sampling generator"))
    quantization: str | None = field(default=None, metadata=doc(
        "weight format to quantize dense weights into on load (e.g. int8)",
        none_means="the checkpoint's weights as stored"))
    attention_backend: str = field(default="auto", metadata=doc(
        "a registered attention backend: auto (on a GPU triton where installed, else torch; on "
        "the CPU cpu where kiln's kernels build, else torch), torch, cpu, triton"))
    linear_backend: Literal["auto", "vnni", "onednn", "bf16-fp32", "torch"] = field(
        default="auto", metadata=doc(
            "dense matmuls; auto: vnni (kiln's kernel on weights packed for AVX512-BF16 dot "
            "products) on such CPUs without AMX, else oneDNN prepacked bf16 where it runs, else "
            "bf16-fp32 (kiln's kernel widening bf16 weights to fp32), else torch"))
    kernels: Literal["auto", "torch", "cpp", "triton"] = field(default="auto", metadata=doc(
        "the model's fused ops: auto (on a GPU triton where installed; on the CPU cpp where "
        "kiln's C++ kernels build), torch (the reference), cpp, triton (on a CPU only in "
        "Triton's interpreter, for tests)"))
    enforce_eager: bool = field(default=False, metadata=doc(
        "on a GPU, run every step eagerly: no CUDA graphs for decode steps"))

    def __post_init__(self):
        check_choices(self)
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = field(default=16, metadata=doc("tokens per KV block, a power of two"))
    kv_cache_memory: int | None = field(default=None, metadata=doc(
        "bytes for K and V of all layers",
        none_means="on a GPU, what gpu_memory_utilization leaves; on the CPU, max_model_len x "
                   "max_num_seqs tokens' worth, up to max_kv_cache_memory"))
    enable_prefix_caching: bool = field(default=True, metadata=doc(
        "reuse KV blocks of identical prompt prefixes", flag="--prefix-caching"))
    max_kv_cache_memory: int = field(default=2 * GiB, metadata=doc(
        "cap in bytes on the derived KV cache size (on the CPU)"))
    gpu_memory_utilization: float = field(default=0.9, metadata=doc(
        "on a GPU, the fraction of its memory kiln may hold (weights, activations and the KV "
        "pool, which takes the rest) unless kv_cache_memory is given"))

    def __post_init__(self):
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], "
                             f"got {self.gpu_memory_utilization}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be positive bytes, got {self.kv_cache_memory}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = field(default=64, metadata=doc("running sequences per step"))
    max_num_batched_tokens: int = field(default=2048, metadata=doc(
        "tokens per step (decodes first, then prefill chunks)"))
    enable_chunked_prefill: bool = field(default=True, metadata=doc(
        "split long prompts across steps under the token budget", flag="--chunked-prefill"))
    policy: Literal["fcfs", "priority"] = field(default="fcfs", metadata=doc(
        "admission order; priority: the request's `priority` (lower first), then arrival"))

    def __post_init__(self):
        check_choices(self)
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    speculative: SpeculativeConfig | None = None  # speculative decoding; None = off
    structured: StructuredConfig = field(default_factory=lambda: StructuredConfig())  # grammars

    def __post_init__(self):
        if self.parallel.data_parallel_size > 1 and self.speculative is not None:
            raise ValueError(f"data_parallel_size {self.parallel.data_parallel_size} with "
                             f"speculative decoding: not supported yet (a rank's drafts and "
                             f"their KV moves would have to follow its requests)")

    def replace(self, **changes) -> EngineConfig:
        return dataclasses.replace(self, **changes)


# the sections of EngineConfig whose fields `engine_config_from` takes by name (the
# speculative section is built from a speculator's name: kiln.speculative.resolve)
SETTING_SECTIONS = ("model", "cache", "scheduler", "parallel", "structured")


def engine_config_from(settings: Mapping[str, object]) -> EngineConfig:
    """An EngineConfig from flat settings named after its sections' fields (`dtype`,
    `block_size`, `max_num_seqs`, `repetition_guard`, ...: `LLM(**settings)`), defaults
    elsewhere. TypeError names a setting that is no field, and the closest one that is."""
    sections = setting_sections()
    by_section: dict[str, dict[str, object]] = {name: {} for name in SETTING_SECTIONS}
    for name, value in settings.items():
        if name not in sections:
            raise TypeError(unknown_setting(name, sections))
        by_section[sections[name]][name] = value
    section_types = typing.get_type_hints(EngineConfig)
    return EngineConfig(**{section: section_types[section](**values)
                           for section, values in by_section.items()})


@functools.cache
def setting_sections() -> dict[str, str]:
    """Each setting `engine_config_from` takes -> the EngineConfig section it belongs to."""
    hints = typing.get_type_hints(EngineConfig)
    sections: dict[str, str] = {}
    for section in SETTING_SECTIONS:
        for f in dataclasses.fields(hints[section]):
            if f.name in sections:
                raise TypeError(f"setting {f.name!r} is in both {sections[f.name]} and {section}")
            sections[f.name] = section
    return sections


def unknown_setting(name: str, known: typing.Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(known), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"unknown engine setting {name!r}{hint}"


def default_num_threads() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


# -- serving (kiln serve) ---------------------------------------------------------------------

MiB = 1 << 20
WorkerRole = Literal["both", "prefill", "decode"]


@dataclass(frozen=True)
class WorkerConfig:
    """What one engine worker process needs: its engine, where the gateway is, how often to
    report. Sent to a spawned worker as JSON on its command line."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    gateway_address: str = field(default="", metadata=doc(
        "the gateway's tcp://HOST:PORT (its ZMQ ROUTER socket) to connect to", flag="--gateway"))
    worker_id: str = field(default="worker-0", metadata=doc(
        "unique name among one gateway's workers (its ZMQ identity prefix)"))
    heartbeat_interval_s: float = field(default=0.5, metadata=doc(
        "seconds between worker heartbeats (sent idle or stepping)"))
    parent_pid: int | None = field(default=None, metadata=doc(
        "exit when this process is gone (workers kiln serve spawns)", cli=False))
    # cluster (kiln.cluster): see ClusterConfig for the gateway's side
    role: WorkerRole = field(default="both", metadata=doc(
        "which work the gateway routes here"))
    transfer_host: str = field(default="127.0.0.1", metadata=doc(
        "interface the KV transfer socket binds (0.0.0.0: all, for decode workers on other "
        "machines)"))
    advertise_host: str | None = field(default=None, metadata=doc(
        "address other workers dial for KV transfers", none_means="transfer_host"))
    pull_timeout_s: float = field(default=10.0, metadata=doc(
        "seconds after which a KV pull not done is given up (the prompt is recomputed); <= 30"))
    hold_timeout_s: float = field(default=30.0, metadata=doc(
        "seconds after which blocks held for a transfer nobody pulls are freed; <= 30"))

    def __post_init__(self):
        check_choices(self)
        if self.heartbeat_interval_s <= 0:
            raise ValueError(f"heartbeat_interval_s must be > 0, got {self.heartbeat_interval_s}")
        if not self.worker_id or "." in self.worker_id:
            raise ValueError(f"worker_id must be non-empty without '.', got {self.worker_id!r}")
        if not 0 < self.pull_timeout_s <= 30 or not 0 < self.hold_timeout_s <= 30:
            raise ValueError("pull_timeout_s and hold_timeout_s must be in (0, 30]")
        if self.role != "both" and self.engine.parallel.world_size > 1:
            raise ValueError(f"a {self.role} worker moves KV blocks to other workers, which "
                             f"tensor or pipeline parallelism does not support yet (each rank "
                             f"holds only its heads or layers): use one rank, got "
                             f"{self.engine.parallel.world_size}")


@dataclass(frozen=True)
class ServeConfig:
    """The HTTP gateway: where it listens, who may call it, what it admits, how it supervises
    its worker and shuts down. Each field is a `kiln serve` flag (kiln.config_cli)."""

    host: str = field(default="127.0.0.1", metadata=doc("interface to listen on"))
    port: int = field(default=8000, metadata=doc("TCP port to listen on"))
    api_keys: tuple[str, ...] = field(default=(), metadata=doc(
        "an API key (repeatable); when set, every route but /health needs a Bearer key",
        flag="--api-key"))
    served_model_name: str | None = field(default=None, metadata=doc(
        "the model name clients send", none_means="the model directory's name"))
    pricing_file: str | None = field(default=None, metadata=doc(
        "JSON/TOML price table by model name, USD per 1M tokens", none_means="built-in",
        flag="--pricing"))
    max_n: int = field(default=16, metadata=doc("cap on `n` (choices per prompt)"))
    max_top_logprobs: int = field(default=20, metadata=doc(
        "cap on `top_logprobs` / `logprobs` (<= 20)"))
    max_body_bytes: int = field(default=8 * MiB, metadata=doc("larger request bodies get 413"))
    admission_queue_size: int = field(default=256, metadata=doc(
        "sequences that may wait beyond --max-num-seqs; more get 429"))
    shutdown_timeout_s: float = field(default=30.0, metadata=doc(
        "SIGTERM: seconds to drain, then the rest are aborted"))
    restart_worker: bool = field(default=True, metadata=doc(
        "restart a dead or stuck worker (--no-restart: it stays down)", flag="--restart"))
    heartbeat_timeout_s: float = field(default=30.0, metadata=doc(
        "seconds of silence after which a worker is declared stuck"))
    worker_start_timeout_s: float = field(default=600.0, metadata=doc(
        "seconds a worker may take to load the model and say it is ready"))
    access_log: bool = field(default=False, metadata=doc(
        "uvicorn's line per request (costs gateway CPU per request)"))
    tool_call_parser: Literal["auto", "hermes", "json"] = field(default="auto", metadata=doc(
        "tool-call syntax: hermes (<tool_call>{...}</tool_call>), json (a bare object), or "
        "auto (from the chat template)"))
    cluster: ClusterConfig = field(default_factory=lambda: ClusterConfig())  # workers, routing

    def __post_init__(self):
        check_choices(self)
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


# -- cluster (kiln.cluster) ---------------------------------------------------------------------


@dataclass(frozen=True)
class ClusterConfig:
    """Workers behind the gateway: how many it spawns and in which roles, how it routes, when
    it disaggregates prefill from decode, what it does when a worker dies. `kiln serve` flags."""

    num_workers: int = field(default=1, metadata=doc(
        "aggregated workers to spawn (0: only workers that join)", flag="--workers"))
    num_prefill_workers: int = field(default=0, metadata=doc(
        "disaggregated: prefill workers to spawn (with --decode-workers)",
        flag="--prefill-workers"))
    num_decode_workers: int = field(default=0, metadata=doc(
        "disaggregated: decode workers to spawn (with --prefill-workers)",
        flag="--decode-workers"))
    router: Literal["round-robin", "least-load", "kv-aware"] = field(
        default="kv-aware", metadata=doc("how a request picks its worker"))
    router_temperature: float = field(default=0.0, metadata=doc(
        "kv-aware: 0 = the cheapest worker; > 0 samples by softmax of -cost / T"))
    prefill_weight: float = field(default=1.0, metadata=doc(
        "kv-aware: cost of one uncached prompt block vs one held KV block"))
    disagg_min_tokens: int = field(default=512, metadata=doc(
        "shorter prompts prefill on the decode worker itself (no transfer)"))
    migration: bool = field(default=True, metadata=doc(
        "resume the streams of a dead worker elsewhere (--no-migration: they end with an "
        "error event)"))
    max_migrations: int = field(default=3, metadata=doc(
        "retries + migrations per request before it fails"))
    address: str | None = field(default=None, metadata=doc(
        "tcp://HOST:PORT the gateway binds for `kiln worker` joins (KV events on PORT+1)",
        none_means="no joins", flag="--cluster-address"))
    overload_waiting: int = field(default=64, metadata=doc(
        "a worker with this many waiting sequences is skipped by the router"))

    def __post_init__(self):
        check_choices(self)
        if min(self.num_workers, self.num_prefill_workers, self.num_decode_workers) < 0:
            raise ValueError("worker counts must be >= 0")
        if (self.num_prefill_workers > 0) != (self.num_decode_workers > 0):
            raise ValueError("give both --prefill-workers and --decode-workers, or neither")
        if self.router_temperature < 0 or self.prefill_weight < 0:
            raise ValueError("router_temperature and prefill_weight must be >= 0")
        if self.disagg_min_tokens < 1 or self.max_migrations < 0 or self.overload_waiting < 1:
            raise ValueError("disagg_min_tokens >= 1, max_migrations >= 0, overload_waiting >= 1")
        if self.address is not None and not self.address.startswith("tcp://"):
            raise ValueError(f"the cluster address must be tcp://HOST:PORT, got {self.address!r}")

    @property
    def disaggregated(self) -> bool:
        return self.num_prefill_workers > 0

    @property
    def num_spawned(self) -> int:
        if self.disaggregated:
            return self.num_prefill_workers + self.num_decode_workers
        return self.num_workers


# -- structured output and the repetition guard (kiln.structured) --------------------------------


@dataclass(frozen=True)
class StructuredConfig:
    """Grammar compilation limits and the repetition guard's default. The gateway applies the
    same compile limits when it validates a request (so a bad grammar is a 400 there)."""

    repetition_guard: Literal["off", "stop", "retry"] = field(default="stop", metadata=doc(
        "a sequence stuck repeating: stop it (finish_reason repetition), retry (redraw the "
        "looping token once, then stop), or off; a request may choose its own"))
    compile_timeout_s: float = field(default=4.0, metadata=doc(
        "seconds a structured-output grammar may take to compile (else 400)",
        flag="--grammar-compile-timeout"))
    cache_bytes: int = field(default=128 * MiB, metadata=doc(
        "compiled grammars kept, in bytes (LRU by xgrammar's size estimate)",
        flag="--grammar-cache-bytes"))
    max_source_bytes: int = field(default=1 * MiB, metadata=doc(
        "longest schema / regex / EBNF / tool set accepted, in bytes",
        flag="--grammar-max-source-bytes"))
    compile_threads: int = field(default=2, metadata=doc(
        "background grammar compile threads (the step loop never waits on one)",
        flag="--grammar-compile-threads"))

    def __post_init__(self):
        check_choices(self)
        _positive(self, "compile_timeout_s", "cache_bytes", "max_source_bytes",
                  "compile_threads")
