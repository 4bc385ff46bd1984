"""SamplingParams: how one request decodes, with vLLM's names. Validated on construction.

It is a msgspec Struct so the same object crosses the gateway-worker boundary unchanged.
Invalid values raise `ValueError` naming the parameter (the HTTP layer maps it to a 400 with
`param` set from `SamplingParamsError.param`).
"""

from __future__ import annotations

import json
from typing import Literal

import msgspec

MAX_LOGPROBS = 20
GuardMode = Literal["off", "stop", "retry"]


class SamplingParamsError(ValueError):
    """An invalid sampling parameter; `param` names it as the OpenAI API does."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


class StructuredOutputsParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Constrain the output to a grammar (kiln.structured; vLLM's names). Exactly one of
    `json`, `regex`, `choice`, `grammar`, `json_object`, `structural_tag` is set."""

    json: str | dict | None = None  # a JSON schema (dict or JSON text; kept as JSON text)
    regex: str | None = None  # the whole output matches this regular expression
    choice: list[str] | None = None  # the output is exactly one of these strings
    grammar: str | None = None  # an EBNF grammar (xgrammar/GBNF dialect, root rule `root`)
    json_object: bool = False  # any JSON object
    structural_tag: str | None = None  # an xgrammar structural tag as JSON text (tool calls)
    # kiln default True (vLLM: False): JSON without free whitespace, so a model cannot emit
    # unbounded whitespace inside JSON (vLLM #40080); False allows a bounded amount
    disable_any_whitespace: bool = True

    def __post_init__(self):
        if isinstance(self.json, dict):
            self.json = json.dumps(self.json, ensure_ascii=False, separators=(",", ":"))
        kinds = self.kinds()
        _check(len(kinds) == 1, "structured_outputs",
               "structured_outputs needs exactly one of json, regex, choice, grammar, "
               f"json_object, structural_tag (got {', '.join(kinds) or 'none'})")
        _check(self.choice is None or (bool(self.choice) and all(
            isinstance(c, str) and c for c in self.choice)), "structured_outputs",
            "structured_outputs.choice must be a non-empty list of non-empty strings")

    def kinds(self) -> list[str]:
        """The constraint kinds that are set (valid params have exactly one)."""
        named = ("json", "regex", "choice", "grammar", "structural_tag")
        return [k for k in named if getattr(self, k) is not None] + (
            ["json_object"] if self.json_object else [])


class RepetitionGuardParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """The repetition guard of one request (kiln.structured.guard; thresholds in
    docs/structured.md). It ends, or redraws once, a sequence stuck repeating itself."""

    mode: GuardMode | None = None  # off | stop | retry; None = the engine's default
    token_run: int = 4  # trip at this many identical word tokens in a row
    filler_run: int = 128  # ... identical whitespace/digit/punctuation tokens in a row
    ngram_period: int = 32  # longest looping n-gram checked (0 = no n-gram check)
    ngram_copies: int = 16  # trip at this many back-to-back copies of one n-gram

    def __post_init__(self):
        _check(self.mode in (None, "off", "stop", "retry"), "repetition_guard",
               f"repetition_guard mode must be off, stop or retry, got {self.mode!r}")
        for name, low in (("token_run", 2), ("filler_run", 2), ("ngram_copies", 2)):
            value = getattr(self, name)
            _check(low <= value <= 1 << 16, "repetition_guard",
                   f"repetition_guard.{name} must be in [{low}, 65536], got {value}")
        _check(self.ngram_period == 0 or 2 <= self.ngram_period <= 256, "repetition_guard",
               f"repetition_guard.ngram_period must be 0 or in [2, 256], got {self.ngram_period}")


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    n: int = 1  # independent completions of the same prompt (they share its KV blocks)
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # nucleus mass in (0, 1]
    top_k: int = 0  # 0 or -1 = off
    min_p: float = 0.0  # drop tokens below min_p x p(most likely)
    presence_penalty: float = 0.0  # OpenAI: subtract once for each token already generated
    frequency_penalty: float = 0.0  # OpenAI: subtract x count of each generated token
    repetition_penalty: float = 1.0  # HF/CTRL: divide (or multiply) logits of prompt+output tokens
    seed: int | None = None  # per-request generator: same seed, same tokens, whatever the batch
    stop: list[str] = msgspec.field(default_factory=list)  # strings that end the output
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False  # keep going past the end-of-sequence token
    max_tokens: int | None = 16  # None = up to the context limit
    min_tokens: int = 0  # EOS and stop tokens are masked until this many tokens exist
    logprobs: int | None = None  # top-k alternatives per output token (0 = only the chosen one)
    prompt_logprobs: int | None = None  # same, for every prompt token after the first
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None  # grammar-constrained output
    repetition_guard: RepetitionGuardParams | None = None  # None = the engine's default guard

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        _check(self.n >= 1, "n", f"n must be >= 1, got {self.n}")
        _check(self.temperature >= 0.0, "temperature",
               f"temperature must be >= 0, got {self.temperature}")
        _check(0.0 < self.top_p <= 1.0, "top_p", f"top_p must be in (0, 1], got {self.top_p}")
        _check(self.top_k >= -1, "top_k", f"top_k must be -1, 0 or positive, got {self.top_k}")
        _check(0.0 <= self.min_p <= 1.0, "min_p", f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(-2.0 <= value <= 2.0, name, f"{name} must be in [-2, 2], got {value}")
        _check(self.repetition_penalty > 0.0, "repetition_penalty",
               f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        _check(self.max_tokens is None or self.max_tokens >= 1, "max_tokens",
               f"max_tokens must be >= 1, got {self.max_tokens}")
        _check(self.min_tokens >= 0, "min_tokens", f"min_tokens must be >= 0, got {self.min_tokens}")
        _check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
               f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(value is None or 0 <= value <= MAX_LOGPROBS, name,
                   f"{name} must be in [0, {MAX_LOGPROBS}], got {value}")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop",
               "stop strings must be non-empty strings")
        _check(all(t >= 0 for t in self.stop_token_ids), "stop_token_ids",
               "stop_token_ids must be non-negative token ids")
        _check(self.seed is None or -(2**63) <= self.seed < 2**63, "seed",
               "seed must fit in a signed 64-bit integer")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def clone(self, **changes) -> SamplingParams:
        return msgspec.structs.replace(self, **changes)


def _check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise SamplingParamsError(param, message)
