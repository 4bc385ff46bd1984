"""A request inside the engine: its tokens, its counts, and one explicit status.

Counting vocabulary (everything else derives from these):
  prompt tokens    -- `prompt_token_ids`, fixed at arrival
  output tokens    -- `output_token_ids`, appended as they are accepted
  all tokens       -- prompt + output (`all_token_ids`, `num_tokens`)
  computed tokens  -- how many leading tokens have KV in the cache (`num_computed_tokens`)
  draft tokens     -- `spec_token_ids`, proposed but not verified; they ride along as extra
                      query tokens in the next step and are never part of `all_token_ids`.

A request needs `num_tokens + len(spec_token_ids) - num_computed_tokens` more tokens computed;
the last computed position samples the next token. Prefill, chunked prefill, decode and
verification are all this one rule.
"""

from __future__ import annotations

import enum
import time

from kiln.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_REPETITION = "repetition"
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self.name.startswith("FINISHED")

    @property
    def finish_reason(self) -> str | None:
        return self.value if self.finished else None


class Request:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 eos_token_ids: frozenset[int] = frozenset(), priority: int = 0,
                 cache_salt: str | None = None, arrival_time: float | None = None):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.eos_token_ids = eos_token_ids
        self.priority = priority
        self.cache_salt = cache_salt
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.spec_token_ids: list[int] = []
        # the proposer's distribution for each draft (opaque here; kiln.runner.verify reads it),
        # or None: drafts were chosen deterministically
        self.spec_draft_probs = None
        # the drafts' parents when they form a tree (kiln.speculative, ScheduledRequest.draft_parents)
        self.spec_parents: list[int] | None = None
        self.num_computed_tokens = 0
        self.num_cached_tokens: int | None = None  # prefix-cache hit at first admission
        self.num_preemptions = 0
        # prompt positions whose logprobs were reported: a recompute after preemption repeats them
        self.num_prompt_logprobs = 0
        self.stop_reason: int | str | None = None
        self.block_hashes: list[bytes] = []  # chained hashes of full blocks, grown lazily
        # kiln.structured: what the next draw may be (a grammar, a one-draw ban) and the
        # repetition guard; None = unconstrained / unguarded
        self.grammar = None  # TokenConstraint
        self.guard = None  # GuardState

    def clear_drafts(self) -> None:
        """Forget the unverified drafts (after verification or a preemption)."""
        self.spec_token_ids, self.spec_draft_probs, self.spec_parents = [], None, None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self.all_token_ids) + len(self.spec_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def max_output_tokens(self) -> int | None:
        return self.params.max_tokens

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def sort_key(self) -> tuple:
        """Admission order: lower priority value first, then arrival (FCFS)."""
        return (self.priority, self.arrival_time)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.name}, prompt={self.num_prompt_tokens}, "
                f"out={self.num_output_tokens}, computed={self.num_computed_tokens})")
