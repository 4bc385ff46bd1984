"""Token-budget continuous batching: a pure CPU state machine with a two-call contract.

`schedule()` decides how many tokens each request advances this step and returns a
`SchedulerOutput`; the runner executes it; `update(scheduler_output, runner_output)` consumes
the sampled tokens and returns one `EngineCoreOutput` per request that produced tokens or
finished. Between the two calls nothing else may mutate the scheduler.

Policy per step, under `max_num_batched_tokens`:
  1. Running requests first, in admission order (decodes cost 1 token, or 1 + drafts; a
     request mid-prefill gets the next chunk). When the KV pool runs out, the lowest-priority
     running request is preempted (its blocks freed; it will recompute) until the request fits.
  2. Then waiting requests in priority/arrival order, while budget, sequence slots and blocks
     last; prefix-cache hits count as already computed; long prompts are chunked.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from kiln.config import SchedulerConfig
from kiln.engine.contract import (
    EngineCoreOutput,
    RunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
    TokenLogprobs,
    tree_depths,
)
from kiln.engine.kv_manager import KVCacheManager
from kiln.engine.request import Request, RequestStatus


@dataclass(frozen=True)
class TokenCheck:
    """The verdict on one sampled token."""

    keep: bool = True  # False: drop it and sample the same position again (a redraw)
    status: RequestStatus | None = None  # append it, then finish the request with this
    steered: bool = False  # it was drawn narrowed by the JSON closing budget (kiln.structured)


KEEP = TokenCheck()


class TokenChecker(Protocol):
    """Judges each sampled token of `request` before the scheduler appends it (kiln.structured
    plugs in here: the grammar advances, the repetition guard runs). May mutate the request's
    grammar and guard state; must not touch the scheduler."""

    def __call__(self, request: Request, token: int) -> TokenCheck: ...


def keep_every_token(request: Request, token: int) -> TokenCheck:
    """The token check of an engine without structured output (and of unit tests)."""
    return KEEP


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, max_model_len: int,
                 token_check: TokenChecker = keep_every_token):
        self.config = config
        self.kv = kv
        self.max_model_len = max_model_len
        self.requests: dict[str, Request] = {}
        self.running: list[Request] = []
        self._waiting: list[tuple[tuple, int, Request]] = []  # heap of (sort key, seq, request)
        self._counter = itertools.count()
        self._finished_ids: list[str] = []
        self._pending_outputs: list[EngineCoreOutput] = []
        self.num_preemptions = 0
        self.token_check = token_check

    # -- intake ---------------------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_work(self) -> bool:
        return bool(self.running or self._waiting or self._pending_outputs)

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        self.requests[request.request_id] = request
        self._enqueue(request)

    def _enqueue(self, request: Request) -> None:
        key = request.sort_key() if self.config.policy == "priority" else (request.arrival_time,)
        heapq.heappush(self._waiting, (key, next(self._counter), request))

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        """End requests from outside the step (abort); their final output comes next step."""
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is None or request.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self._waiting = [e for e in self._waiting if e[2] is not request]
                heapq.heapify(self._waiting)
            self._finish(request, status)
            self._pending_outputs.append(EngineCoreOutput(
                request_id=rid, new_token_ids=[], finish_reason=status.finish_reason,
                stop_reason=request.stop_reason, num_cached_tokens=request.num_cached_tokens or 0))

    # -- schedule -------------------------------------------------------------------------

    def schedule(self, busy: frozenset[str] = frozenset(),
                 max_seqs: int | None = None) -> SchedulerOutput:
        """The next step. `busy`: running requests whose last step is still in flight (a
        pipeline of stages, kiln.runner.pipeline): neither scheduled nor preempted.
        `max_seqs`: at most this many sequences in the step (None: max_num_seqs)."""
        budget = self.config.max_num_batched_tokens
        max_seqs = max_seqs or self.config.max_num_seqs
        scheduled: list[ScheduledRequest] = []
        preemptions_before = self.num_preemptions
        for request in list(self.running):
            if budget <= 0 or len(scheduled) >= max_seqs:
                break
            if request.status != RequestStatus.RUNNING or request.request_id in busy:
                continue  # preempted earlier in this loop, or in flight
            num_new = min(request.num_tokens_with_spec - request.num_computed_tokens, budget)
            num_new = self._grammar_cap(request, request.num_computed_tokens, num_new)
            if not num_new:
                continue  # its grammar still compiles (or failed: it was finished)
            if not self._allocate_or_preempt(request, num_new, scheduled, busy):
                continue
            scheduled.append(self._describe(request, num_new))
            budget -= num_new
        if self.num_preemptions == preemptions_before:
            budget = self._admit_waiting(scheduled, budget, max_seqs)
        out = SchedulerOutput(scheduled, self.config.max_num_batched_tokens - budget,
                              self._finished_ids)
        self._finished_ids = []
        return out

    def _allocate_or_preempt(self, request: Request, num_new: int,
                             scheduled: list[ScheduledRequest], busy: frozenset[str]) -> bool:
        """Allocate, preempting requests neither scheduled this step nor `busy` (possibly
        `request`)."""
        while not self.kv.allocate(request, num_new):
            taken = {s.request_id for s in scheduled} | busy
            pool = self.kv.dp_rank(request.request_id)  # (data-parallel ranks: its pool's)
            candidates = [r for r in self.running if r.request_id not in taken
                          and self.kv.dp_rank(r.request_id) == pool]
            victim = (max(candidates, key=lambda r: r.sort_key())
                      if self.config.policy == "priority" else candidates[-1])
            self._preempt(victim)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.clear_drafts()
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(request)

    def _admit_waiting(self, scheduled: list[ScheduledRequest], budget: int,
                       max_seqs: int) -> int:
        deferred = []  # waiting for their grammar with nothing to prefill meanwhile
        while (self._waiting and budget > 0 and len(self.running) < self.config.max_num_seqs
               and len(scheduled) < max_seqs):
            request = self._waiting[0][2]
            cached = self.kv.find_cached_prefix(request)
            num_cached = len(cached) * self.kv.block_size
            num_new = self._grammar_cap(request, num_cached, request.num_tokens - num_cached)
            if not num_new:
                if num_new == 0:
                    deferred.append(heapq.heappop(self._waiting))
                continue
            if num_new > budget and not self.config.enable_chunked_prefill:
                break
            num_new = min(num_new, budget)
            if not self.kv.allocate(request, num_new, cached):
                break
            heapq.heappop(self._waiting)
            request.num_computed_tokens = num_cached
            if request.num_cached_tokens is None:
                request.num_cached_tokens = num_cached
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append(self._describe(request, num_new))
            budget -= num_new
        for entry in deferred:
            heapq.heappush(self._waiting, entry)
        return budget

    def _grammar_cap(self, request: Request, start: int, num_new: int) -> int | None:
        """Tokens to compute from `start`: all of them, or while the request's grammar still
        compiles, all but the last (which would sample): the prompt prefills meanwhile.
        None if the grammar failed to compile: the request is finished with an error."""
        grammar = request.grammar
        if grammar is None or grammar.ready():
            return num_new
        if grammar.error is not None:
            request.stop_reason = grammar.error
            self.finish_requests([request.request_id], RequestStatus.FINISHED_ERROR)
            return None
        return max(0, min(num_new, request.num_tokens - 1 - start))

    def _describe(self, request: Request, num_new: int) -> ScheduledRequest:
        start = request.num_computed_tokens
        end = start + num_new
        known = request.num_tokens
        drafts = max(0, end - known)
        tokens = request.all_token_ids[start:min(end, known)]
        if drafts:
            tokens = tokens + request.spec_token_ids[:drafts]
        return ScheduledRequest(
            request_id=request.request_id, token_ids=tokens, start_pos=start,
            num_draft_tokens=drafts, block_ids=self.kv.block_ids(request.request_id),
            samples=end >= known, params=request.params,
            prompt_token_ids=request.prompt_token_ids, output_token_ids=request.output_token_ids,
            prompt_logprobs=request.params.prompt_logprobs is not None
            and start < request.num_prompt_tokens,
            grammar=request.grammar,
            draft_probs=None if request.spec_draft_probs is None or not drafts
            else request.spec_draft_probs[:drafts],
            draft_parents=None if request.spec_parents is None or not drafts
            else request.spec_parents[:drafts],
            dp_rank=self.kv.dp_rank(request.request_id))

    # -- update ---------------------------------------------------------------------------

    def update(self, sched: SchedulerOutput, result: RunnerOutput) -> list[EngineCoreOutput]:
        outputs, self._pending_outputs = self._pending_outputs, []
        for i, item in enumerate(sched.scheduled):
            request = self.requests.get(item.request_id)
            if request is None or request.is_finished:
                continue
            out = self._advance(request, item, result, i)
            if out is not None:
                outputs.append(out)
        return outputs

    @staticmethod
    def _new_prompt_logprobs(request: Request, item: ScheduledRequest, result: RunnerOutput,
                             i: int) -> list[TokenLogprobs] | None:
        """The chunk's prompt logprobs (positions start_pos + 1 ..) not reported before: a
        request recomputed after preemption scores its prompt again."""
        chunk = result.prompt_logprobs[i] if result.prompt_logprobs else None
        if not chunk:
            return None
        new = chunk[max(0, request.num_prompt_logprobs - item.start_pos):]
        request.num_prompt_logprobs += len(new)
        return new or None

    def _advance(self, request: Request, item: ScheduledRequest, result: RunnerOutput,
                 i: int) -> EngineCoreOutput | None:
        request.num_computed_tokens += len(item.token_ids)
        prompt_lp = self._new_prompt_logprobs(request, item, result, i)
        if not item.samples:
            return EngineCoreOutput(request.request_id, [], prompt_logprobs=prompt_lp) \
                if prompt_lp else None
        sampled = result.sampled_token_ids[i]
        if item.num_draft_tokens:
            rejected = item.num_draft_tokens + 1 - len(sampled)
            request.num_computed_tokens -= rejected
            self.kv.trim(request, request.num_computed_tokens + 1)
        request.clear_drafts()
        new_tokens: list[int] = []
        redrawn, steered = False, 0
        for token in sampled:
            check = self.token_check(request, token)
            if not check.keep:  # the repetition guard drops it: sample this position again
                redrawn = True
                self._resample_last(request)
                break
            request.append_output_token(token)
            new_tokens.append(token)
            steered += check.steered
            if self._check_stop(request, token, check.status):
                break
        logprobs = result.logprobs[i][:len(new_tokens)] if result.logprobs else None
        return EngineCoreOutput(
            request.request_id, new_tokens, logprobs=logprobs, prompt_logprobs=prompt_lp,
            finish_reason=request.status.finish_reason, stop_reason=request.stop_reason,
            num_cached_tokens=request.num_cached_tokens or 0,
            num_draft_tokens=item.num_draft_tokens,
            num_accepted_tokens=max(0, len(sampled) - 1) if item.num_draft_tokens else 0,
            draft_depth=max(tree_depths(item.draft_parents)) if item.draft_parents else 0,
            num_redraws=int(redrawn), num_closing_steered=steered)

    def _resample_last(self, request: Request) -> None:
        """Forget the KV of the last kept token so the next step computes it again and
        samples the position after it anew (its old sample was dropped)."""
        request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens - 1)
        self.kv.trim(request, request.num_tokens)

    def _check_stop(self, request: Request, token: int,
                    status: RequestStatus | None = None) -> bool:
        """Whether `token` ends the request: `status` (from token_check), EOS, a stop token,
        max_tokens or max_model_len."""
        status = status or self._stop_status(request, token)
        if status is None:
            return False
        self.running.remove(request)
        self._finish(request, status)
        return True

    def _stop_status(self, request: Request, token: int) -> RequestStatus | None:
        params = request.params
        if token in request.eos_token_ids and not params.ignore_eos:
            return RequestStatus.FINISHED_STOPPED
        if token in params.stop_token_ids:
            request.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        if params.max_tokens is not None and request.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def stop_request(self, request: Request, status: RequestStatus) -> None:
        """End a running request from a guard inside the step loop (e.g. repetition)."""
        if request in self.running:
            self.running.remove(request)
        self._finish(request, status)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self.kv.free(request)
        self._finished_ids.append(request.request_id)
        del self.requests[request.request_id]
