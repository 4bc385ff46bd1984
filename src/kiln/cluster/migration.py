"""What the gateway remembers about each engine request it routed, and what happens to it
when its worker is lost. Pure state and decisions; placement.py routes the legs and
supervision.py applies the recovery.

A request's life is a sequence of legs, one worker each:

  LOCAL     the whole request on one worker (aggregated serving, or a prompt shorter than
            --disagg-min-tokens on a decode worker)
  PREFILL   on a prefill worker with max_tokens 1: the prompt and the first token
  HANDOFF   the prefill leg is done; waiting for its PrefillDone (the transfer handle)
  DECODE    on a decode worker: the prompt + tokens so far, blocks pulled from the prefill

When a worker is lost, each of its requests gets one `Recovery`:

  RETRY     nothing was delivered yet (no token, no prompt logprob): send it again, unchanged
  MIGRATE   tokens were streamed: resume elsewhere from prompt + tokens so far (the engine
            treats them as output already produced, so max_tokens, penalties and stop rules
            continue exactly; greedy output equals an undisturbed run)
  FAIL      migration is off, the request ran out of attempts, or a partial prompt-logprob
            stream cannot be resumed: the client gets an error (an SSE error event)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import msgspec

from kiln.cluster.engine_client import OutputStream
from kiln.engine.contract import EngineCoreOutput
from kiln.engine.core import EngineRequest


class Leg(enum.Enum):
    LOCAL = "local"
    PREFILL = "prefill"
    HANDOFF = "handoff"
    DECODE = "decode"


class Recovery(enum.Enum):
    RETRY = "retry"
    MIGRATE = "migrate"
    FAIL = "fail"


@dataclass
class Tracked:
    request: EngineRequest  # as the client submitted it
    stream: OutputStream
    worker: str
    leg: Leg
    salt: str | None = None
    produced: list[int] = field(default_factory=list)  # output tokens delivered so far
    num_cached_tokens: int | None = None  # the first leg's prefix hit (billing)
    delivered_prompt_logprobs: bool = False
    attempts: int = 0  # retries + migrations so far

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def max_tokens(self) -> int | None:
        return self.request.params.max_tokens

    def absorb(self, out: EngineCoreOutput) -> EngineCoreOutput:
        """Record a delivered output; returns it as the client must see it (the cached-token
        count of the first leg, whatever later legs found in their own caches)."""
        if out.prompt_logprobs:
            self.delivered_prompt_logprobs = True
        if self.num_cached_tokens is None:
            self.num_cached_tokens = out.num_cached_tokens
        elif out.num_cached_tokens != self.num_cached_tokens:
            out = _replace(out, num_cached_tokens=self.num_cached_tokens)
        self.produced.extend(out.new_token_ids)
        return out

    def prefill_completes(self, out: EngineCoreOutput, max_model_len: int) -> bool:
        """Whether a prefill leg's final output also ends the whole request."""
        if out.finish_reason != "length":
            return True  # stop token, EOS, abort, error, repetition
        if len(self.request.prompt_token_ids) + len(self.produced) >= max_model_len:
            return True
        return self.max_tokens is not None and len(self.produced) >= self.max_tokens

    def continuation(self) -> EngineRequest:
        """The request resumed after the tokens already delivered."""
        r = self.request
        return EngineRequest(request_id=r.request_id, prompt_token_ids=r.prompt_token_ids,
                             params=r.params.clone(prompt_logprobs=None), priority=r.priority,
                             cache_salt=r.cache_salt, output_token_ids=list(self.produced))

    def resume_tokens(self) -> list[int]:
        """Every token a resumed leg starts from (for routing and load accounting)."""
        return self.request.prompt_token_ids + self.produced


def prefill_request(request: EngineRequest) -> EngineRequest:
    """The prefill leg of `request`: the same, for one token."""
    p = request.params
    params = p.clone(max_tokens=1, min_tokens=min(p.min_tokens, 1))
    return EngineRequest(request_id=request.request_id, prompt_token_ids=request.prompt_token_ids,
                         params=params, priority=request.priority, cache_salt=request.cache_salt)


def without_finish(out: EngineCoreOutput) -> EngineCoreOutput:
    """A prefill leg's last output as the client sees it: the request goes on."""
    return _replace(out, finish_reason=None, stop_reason=None)


def plan_recovery(t: Tracked, migration: bool, max_attempts: int) -> Recovery:
    if t.attempts >= max_attempts:
        return Recovery.FAIL
    if not t.produced:
        return Recovery.FAIL if t.delivered_prompt_logprobs else Recovery.RETRY
    return Recovery.MIGRATE if migration else Recovery.FAIL


def _replace(out: EngineCoreOutput, **changes) -> EngineCoreOutput:
    return msgspec.structs.replace(out, **changes)
