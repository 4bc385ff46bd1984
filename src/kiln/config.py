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
    # dense matmuls: auto (oneDNN prepacked for bf16; without bf16 instructions, bf16-fp32:
    # kiln's kernel widening bf16 weights to fp32), onednn, bf16-fp32, torch
    linear_backend: str = "auto"
    kernels: str = "auto"  # fused C++ CPU ops: auto (where they build), torch (reference), cpp

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.kernels not in ("auto", "torch", "cpp"):
            raise ValueError(f"kernels must be auto, torch or cpp, got {self.kernels!r}")
        if self.linear_backend not in ("auto", "torch", "onednn", "bf16-fp32"):
            raise ValueError(f"linear_backend must be auto, torch, onednn or bf16-fp32, "
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
    speculative: SpeculativeConfig | None = None  # speculative decoding; None = off
    structured: StructuredConfig = field(default_factory=lambda: StructuredConfig())  # grammars

    def replace(self, **changes) -> EngineConfig:
        return dataclasses.replace(self, **changes)


def default_num_threads() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


# -- serving (kiln serve) ---------------------------------------------------------------------

MiB = 1 << 20
WORKER_ROLES = ("both", "prefill", "decode")


@dataclass(frozen=True)
class WorkerConfig:
    """What one engine worker process needs: its engine, where the gateway is, how often to
    report. Sent to a spawned worker as JSON on its command line."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    gateway_address: str = ""  # ZMQ endpoint of the gateway's ROUTER socket to connect to
    worker_id: str = "worker-0"  # ZMQ identity prefix; unique among one gateway's workers
    heartbeat_interval_s: float = 0.5  # a heartbeat at least this often, idle or stepping
    parent_pid: int | None = None  # exit when this process is gone (workers kiln serve spawns)
    # cluster (kiln.cluster): see ClusterConfig for the gateway's side
    role: str = "both"  # prefill | decode | both: which work the gateway routes here
    transfer_host: str = "127.0.0.1"  # interface the KV transfer socket binds
    advertise_host: str | None = None  # host other workers dial for transfers (transfer_host)
    pull_timeout_s: float = 10.0  # a KV pull not done by then is given up: recompute
    hold_timeout_s: float = 30.0  # blocks held for a transfer nobody pulls are freed (<= 30)

    def __post_init__(self):
        if self.heartbeat_interval_s <= 0:
            raise ValueError(f"heartbeat_interval_s must be > 0, got {self.heartbeat_interval_s}")
        if not self.worker_id or "." in self.worker_id:
            raise ValueError(f"worker_id must be non-empty without '.', got {self.worker_id!r}")
        if self.role not in WORKER_ROLES:
            raise ValueError(f"role must be one of {WORKER_ROLES}, got {self.role!r}")
        if not 0 < self.pull_timeout_s <= 30 or not 0 < self.hold_timeout_s <= 30:
            raise ValueError("pull_timeout_s and hold_timeout_s must be in (0, 30]")


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
    access_log: bool = False  # uvicorn's line per request (costs gateway CPU per request)
    tool_call_parser: str = "auto"  # auto (from the chat template) | hermes | json
    cluster: ClusterConfig = field(default_factory=lambda: ClusterConfig())  # workers, routing

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


# -- speculative decoding (kiln.speculative) ---------------------------------------------------------


MAX_TREE_WIDTH = 8
# drafts in one request's tree: with its root, a query of 32 tokens (decode-sized: the fused
# stack's matmuls and the short-query attention kernel, which draft trees stay in)
MAX_TREE_DRAFTS = 31
DEFAULT_TREE_DRAFTS = 15  # tree_size by default (lookup's and a draft model's)
# a head's draft trees by default: 3 continuations, up to 12 drafts, lookup's continuation
# joining them (ngram_first), where one sequence decodes (tree_max_batch): the fastest shape
# measured on code at batch 1 (see docs/decisions/0005); chains elsewhere, as SGLang's EAGLE
# picks a tree for its users
HEAD_TREE_WIDTH, HEAD_TREE_DRAFTS = 3, 12
# and those trees hold the head's nodes of path probability >= this (tree_min_prob): a step
# verifies few drafts where the head is sure and up to 12 where it is not. At batch 1, k = 3
# forced, 32 prompts, it ran 1.06x the fixed 3 x 12 on both code and prose with about the same
# drafts accepted (see docs/decisions/0006)
HEAD_TREE_MIN_PROB = 0.03


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: a proposer guesses the next tokens, the target verifies them in one
    forward pass (losslessly: greedy output is unchanged, sampled output keeps its distribution).
    `LLM(speculator=...)` and `kiln serve --speculator` build one from a name or a directory."""

    method: str = "ngram"  # registered proposer: ngram (prompt lookup), draft (model), head (EAGLE)
    model: str | None = None  # draft: an HF checkpoint sharing the tokenizer; head: a head dir
    num_speculative_tokens: int = 3  # most drafts per sequence per step (k)
    adaptive: bool = True  # choose k per step by measured cost and acceptance (0 = off)
    max_batch_size: int | None = None  # no drafts when more sequences run; None = no cap
    ngram_min: int = 1  # ngram: shortest suffix to look up in the prompt and output
    ngram_max: int = 4  # ngram: longest suffix to look up (longer matches win)
    draft_kv_cache_memory: int | None = None  # draft: bytes for its KV cache; None = derived
    # draft/head: an n-gram match's drafts when there is one (None: on for a head, off for a
    # draft model)
    ngram_first: bool | None = None
    speculator_int8: bool = True  # head/draft: int8 weight-only linears, decode-sized inputs
    # head/draft with a draft vocabulary: greedy verify steps score the whole vocabulary only
    # on the rows the walk visits, the draft vocabulary guessing the others (lossless:
    # kiln.speculative.shortlist; see docs/decisions/0009)
    verify_shortlist: bool = True
    # draft trees: up to this many alternative continuations per request and step, verified
    # in one forward (n-gram: several earlier occurrences' continuations, merged by common
    # prefix; head: a beam search this wide, its k * width likeliest nodes; with
    # ngram_first, a match passed over for the head joins its tree); 1 = one chain of drafts.
    # With adaptive speculation each step still picks a tree or a chain, whichever has made
    # more tokens per unit of cost (spec/adaptive.py, TreeChoice). None: HEAD_TREE_WIDTH for
    # a head, 1 otherwise
    tree_width: int | None = None
    # most drafts in one tree (SGLang's --speculative-num-draft-tokens): a tree's first this
    # many nodes (the head's likeliest; in a merged tree lookup's first continuation, the
    # head's, then lookup's others). None: HEAD_TREE_DRAFTS for a head, DEFAULT_TREE_DRAFTS
    # otherwise
    tree_size: int | None = None
    # a head's tree by probability (a dynamic tree size): the head's nodes whose path
    # probability is at least this, up to tree_size of them, rather than its `k * width`
    # likeliest (with ngram_first, lookup's first continuation still goes first and its others
    # stay out). The head's probabilities are calibrated, so a step where it is sure verifies
    # a few drafts and one where it is not verifies many: more accepted per draft verified
    # (see docs/decisions/0006). 0: a fixed size, the `k * width` likeliest;
    # None: HEAD_TREE_MIN_PROB for a head (lookup's and a draft model's trees have no floor)
    tree_min_prob: float | None = None
    # trees only in steps where at most this many sequences decode (chains above): at small
    # batches a step's cost hardly grows with its query tokens, at larger ones a tree's
    # extra tokens cost more than they bring (see docs/decisions/0005)
    tree_max_batch: int = 1

    def __post_init__(self):
        if not self.method:
            raise ValueError("speculative method must be a proposer name (ngram, draft, head)")
        if self.method in ("draft", "head") and not self.model:
            raise ValueError(f"speculative method {self.method!r} needs a model directory")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"num_speculative_tokens must be in [1, 16], "
                             f"got {self.num_speculative_tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min}, "
                             f"{self.ngram_max}")
        if self.tree_width is not None and not 1 <= self.tree_width <= MAX_TREE_WIDTH:
            raise ValueError(f"tree_width must be in [1, {MAX_TREE_WIDTH}], got "
                             f"{self.tree_width}")
        if self.tree_size is not None and not 1 <= self.tree_size <= MAX_TREE_DRAFTS:
            raise ValueError(f"tree_size must be in [1, {MAX_TREE_DRAFTS}], got "
                             f"{self.tree_size}")
        if self.tree_min_prob is not None and not 0 <= self.tree_min_prob < 1:
            raise ValueError(f"tree_min_prob must be in [0, 1), got {self.tree_min_prob}")
        if self.tree_max_batch < 1:
            raise ValueError(f"tree_max_batch must be >= 1, got {self.tree_max_batch}")
        if self.max_batch_size is not None and self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")

    def resolved(self) -> SpeculativeConfig:
        """This config with its method's defaults in place of None (what the engine runs):
        a head drafts trees by probability with lookup joined, lookup and a draft model chains
        alone."""
        head = self.method == "head"
        return dataclasses.replace(
            self,
            ngram_first=head if self.ngram_first is None else self.ngram_first,
            tree_width=self.tree_width or (HEAD_TREE_WIDTH if head else 1),
            tree_size=self.tree_size or (HEAD_TREE_DRAFTS if head else DEFAULT_TREE_DRAFTS),
            tree_min_prob=(self.tree_min_prob if self.tree_min_prob is not None
                           else HEAD_TREE_MIN_PROB if head else 0.0))


# -- cluster (kiln.cluster) ---------------------------------------------------------------------


@dataclass(frozen=True)
class ClusterConfig:
    """Workers behind the gateway: how many it spawns and in which roles, how it routes, when
    it disaggregates prefill from decode, what it does when a worker dies. `kiln serve` flags."""

    num_workers: int = 1  # aggregated workers to spawn (--workers)
    num_prefill_workers: int = 0  # disaggregated: prefill workers to spawn (--prefill-workers)
    num_decode_workers: int = 0  # disaggregated: decode workers to spawn (--decode-workers)
    router: str = "kv-aware"  # round-robin | least-load | kv-aware
    router_temperature: float = 0.0  # kv-aware: 0 = cheapest worker; > 0 = softmax sampling
    prefill_weight: float = 1.0  # kv-aware: cost of one uncached prompt block vs one KV block
    disagg_min_tokens: int = 512  # shorter prompts prefill on the decode worker itself
    migration: bool = True  # resume streams of a dead worker elsewhere (--no-migration)
    max_migrations: int = 3  # retries + migrations per request before it fails
    address: str | None = None  # tcp://HOST:PORT the gateway binds for `kiln worker` joins
    overload_waiting: int = 64  # a worker with this many waiting sequences is skipped

    def __post_init__(self):
        if min(self.num_workers, self.num_prefill_workers, self.num_decode_workers) < 0:
            raise ValueError("worker counts must be >= 0")
        if (self.num_prefill_workers > 0) != (self.num_decode_workers > 0):
            raise ValueError("give both --prefill-workers and --decode-workers, or neither")
        if self.router not in ("round-robin", "least-load", "kv-aware"):
            raise ValueError(f"router must be round-robin, least-load or kv-aware, "
                             f"got {self.router!r}")
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

    repetition_guard: str = "stop"  # off | stop | retry: what a request without its own does
    compile_timeout_s: float = 4.0  # a grammar not compiled by then is refused (400)
    cache_bytes: int = 128 * MiB  # compiled grammars kept (LRU by xgrammar's size estimate)
    max_source_bytes: int = 1 * MiB  # longest schema / regex / EBNF / tool set accepted
    compile_threads: int = 2  # background compile threads (the step loop never waits on one)

    def __post_init__(self):
        if self.repetition_guard not in ("off", "stop", "retry"):
            raise ValueError(f"repetition_guard must be off, stop or retry, "
                             f"got {self.repetition_guard!r}")
        _positive(self, "compile_timeout_s", "cache_bytes", "max_source_bytes",
                  "compile_threads")
