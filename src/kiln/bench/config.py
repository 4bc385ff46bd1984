"""Typed, frozen configuration of one `kiln bench serve` run.

A `BenchConfig` is everything that decides what a run sends and how it is judged: the server,
the load shape, the workload and the SLOs. It is written verbatim into the result file, so a
result can be reproduced from its own config (the API key is never part of it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum


class Endpoint(str, Enum):
    """Which OpenAI route the client streams from."""

    CHAT = "chat"  # /v1/chat/completions, `messages`
    COMPLETIONS = "completions"  # /v1/completions, `prompt` (the message contents joined)

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self is Endpoint.CHAT else "/v1/completions"


class WorkloadKind(str, Enum):
    RANDOM = "random"
    SHARED_PREFIX = "shared-prefix"
    MULTI_TURN = "multi-turn"
    LONG_CONTEXT = "long-context"
    JSONL = "jsonl"


@dataclass(frozen=True)
class ServerConfig:
    base_url: str  # e.g. http://127.0.0.1:8000 (no trailing /v1)
    model: str  # the `model` field sent with every request
    endpoint: Endpoint = Endpoint.CHAT
    ignore_eos: bool = True  # send `ignore_eos: true` so every reply has its full max_tokens
    request_timeout_s: float = 600.0  # a request still running after this is a "timeout" error
    temperature: float = 0.0  # sent with every request (vLLM's client sends none: 1.0)

    def __post_init__(self) -> None:
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"--base-url must start with http:// or https://, got {self.base_url!r}")
        object.__setattr__(self, "base_url", self.base_url.rstrip("/").removesuffix("/v1"))
        _require(self.request_timeout_s > 0, "--request-timeout must be > 0")
        _require(self.temperature >= 0, "--temperature must be >= 0")

    @property
    def url(self) -> str:
        return self.base_url + self.endpoint.path


@dataclass(frozen=True)
class LoadConfig:
    """How requests are released. Exactly one of `rate` mode and `concurrency` mode applies.

    Rate mode (`concurrency is None`): sessions start at gamma-distributed gaps with mean 1/rate
    (burstiness 1 = Poisson; < 1 burstier, > 1 more regular); `rate=None` starts all at once.
    Concurrency mode: a fixed number of sessions are in flight, each starting when one ends.
    A session is one request for every workload except multi-turn, whose turns run in order.
    """

    num_requests: int  # total requests issued (a cap; the workload decides the natural count)
    seed: int = 0  # seeds prompts, lengths and arrival gaps
    rate: float | None = None  # sessions per second in rate mode; None = all at once
    burstiness: float = 1.0  # gamma shape of the inter-arrival gaps
    concurrency: int | None = None  # sessions in flight; set means concurrency mode
    warmup_requests: int = 1  # short untimed requests sent first (never counted)
    max_duration_s: float | None = None  # stop and cancel what is in flight after this

    def __post_init__(self) -> None:
        _require(self.num_requests >= 1, "--num-requests must be >= 1")
        _require(self.rate is None or (self.rate > 0 and math.isfinite(self.rate)),
                 "--rate must be a positive number or inf")
        _require(self.burstiness > 0, "--burstiness must be > 0")
        _require(self.concurrency is None or self.concurrency >= 1, "--concurrency must be >= 1")
        _require(self.concurrency is None or self.rate is None,
                 "give either --rate or --concurrency, not both")
        _require(self.warmup_requests >= 0, "--warmup must be >= 0")
        _require(self.max_duration_s is None or self.max_duration_s > 0,
                 "--max-duration must be > 0")

    def describe(self) -> str:
        if self.concurrency is not None:
            return f"concurrency {self.concurrency}"
        return "rate inf" if self.rate is None else f"rate {self.rate:g}/s"


@dataclass(frozen=True)
class WorkloadConfig:
    """One workload's shape; lengths are in tokens of the server's tokenizer.

    Each field says which workloads read it. `input_len` is the fresh prompt text per request
    (the question after a shared prefix, the new user message of a turn).
    """

    kind: WorkloadKind = WorkloadKind.RANDOM
    input_len: int = 128  # random, shared-prefix, multi-turn, long-context
    output_len: int = 128  # all (jsonl: lines that give none)
    range_ratio: float = 0.0  # lengths drawn uniformly from len*(1 -/+ ratio); all but jsonl
    groups: int = 4  # shared-prefix: distinct shared prefixes
    prompts_per_group: int = 8  # shared-prefix: prompts after each prefix
    system_len: int = 512  # shared-prefix: prefix; multi-turn: system prompt shared by sessions
    sessions: int = 4  # multi-turn: conversations
    turns: int = 4  # multi-turn: requests per conversation
    first_input_len: int = 512  # multi-turn: the first user message (task plus code context)
    dataset: str | None = None  # jsonl: path of the request file

    def __post_init__(self) -> None:
        for name in ("input_len", "output_len", "groups", "prompts_per_group", "sessions",
                     "turns", "first_input_len"):
            _require(getattr(self, name) >= 1, f"--{name.replace('_', '-')} must be >= 1")
        _require(self.system_len >= 0, "--system-len must be >= 0")
        _require(0.0 <= self.range_ratio < 1.0, "--range-ratio must be in [0, 1)")
        _require(self.kind is not WorkloadKind.JSONL or self.dataset is not None,
                 "the jsonl workload needs --dataset FILE")


# Defaults that differ by workload; anything not named here takes the WorkloadConfig default.
WORKLOAD_DEFAULTS: dict[WorkloadKind, dict[str, int]] = {
    WorkloadKind.RANDOM: {"input_len": 128, "output_len": 128},
    WorkloadKind.SHARED_PREFIX: {"input_len": 64, "output_len": 64, "system_len": 512},
    WorkloadKind.MULTI_TURN: {"input_len": 64, "output_len": 64, "system_len": 256},
    WorkloadKind.LONG_CONTEXT: {"input_len": 3072, "output_len": 64},
    WorkloadKind.JSONL: {"output_len": 128},
}


@dataclass(frozen=True)
class SLO:
    """Service-level objectives in milliseconds; a request is "good" if it meets every one set."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    @property
    def any(self) -> bool:
        return any(v is not None for v in (self.ttft_ms, self.tpot_ms, self.e2e_ms))


_SLO_KEYS = {"ttft": "ttft_ms", "tpot": "tpot_ms", "e2e": "e2e_ms", "e2el": "e2e_ms"}


def parse_slo(text: str | None) -> SLO:
    """`ttft=500,tpot=50[,e2e=10000]` (milliseconds) -> SLO."""
    if not text:
        return SLO()
    values: dict[str, float] = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        if not sep or key.strip() not in _SLO_KEYS:
            raise ValueError(f"bad --slo item {item!r}; use ttft=MS,tpot=MS,e2e=MS")
        ms = float(value)
        _require(ms > 0, f"--slo {key.strip()} must be > 0")
        values[_SLO_KEYS[key.strip()]] = ms
    return SLO(**values)


@dataclass(frozen=True)
class BenchConfig:
    server: ServerConfig
    load: LoadConfig
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    slo: SLO = field(default_factory=SLO)
    tokenizer: str | None = None  # tokenizer directory used to size prompts (recorded)
    label: str | None = None  # series name in plots and comparisons

    @property
    def name(self) -> str:
        return self.label or f"{self.server.model} @ {self.server.base_url.split('://', 1)[-1]}"


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
