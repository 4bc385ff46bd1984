"""The engine side of speculative decoding: after each step, drafts for the running requests.

`EngineCore` owns one `Speculator` when `EngineConfig.speculative` is set and calls
`after_step` once per step, after `Scheduler.update`, so requests hold verified tokens only:

  1. the adaptive controller gets the step's measured cost and each request's acceptance;
  2. it picks k for the next step (0 = no drafts this time);
  3. the proposer guesses up to k tokens for each running request that just sampled, capped
     so a draft never sits past `max_tokens` (the bonus token needs the last slot) or
     `max_model_len` (with `ngram_first`, requests whose text has an n-gram match take its
     drafts instead: on text that repeats itself, lookup beats a small model);
  4. each guess passes `draft_filter`, the seam for structured output (a grammar keeps the
     drafts it accepts), and lands in `request.spec_token_ids` (and `spec_draft_probs`),
     where the scheduler picks it up as extra query tokens.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kiln.config import SpeculativeConfig
from kiln.engine.outputs import EngineCoreOutput
from kiln.engine.request import Request, RequestStatus
from kiln.engine.scheduler import Scheduler, SchedulerOutput
from kiln.spec.adaptive import AdaptiveK
from kiln.spec.ngram import propose_ngram
from kiln.spec.proposer import Draft, DraftRequest, ProposerContext, build_proposer

# (request, drafts) -> how many leading drafts to keep
DraftFilter = Callable[[Request, list[int]], int]


@dataclass
class SpecStats:
    """Totals since the engine started (for /metrics)."""

    num_draft_tokens: int = 0  # drafts verified
    num_accepted_tokens: int = 0  # of which were accepted
    num_verify_steps: int = 0  # request-steps that verified at least one draft

    @property
    def mean_accepted_length(self) -> float:
        return self.num_accepted_tokens / self.num_verify_steps if self.num_verify_steps else 0.0


class Speculator:
    def __init__(self, config: SpeculativeConfig, ctx: ProposerContext, scheduler: Scheduler):
        self.config = config
        self.scheduler = scheduler
        self.max_model_len = ctx.max_model_len
        self.proposer = build_proposer(config, ctx)
        self.adaptive = AdaptiveK(config.num_speculative_tokens, config.adaptive,
                                  config.max_batch_size)
        self.draft_filter: DraftFilter | None = None
        self.stats = SpecStats()
        self._asked: dict[str, tuple[int, int]] = {}  # request -> (drafts asked, proposed)
        self._last: tuple[int, int, float] | None = None  # (batch, k, propose seconds)
        self._lookup = config.ngram_first and config.method != "ngram"

    def after_step(self, sched: SchedulerOutput, outputs: list[EngineCoreOutput],
                   step_seconds: float) -> None:
        """Measure the step that ran, then set the drafts of the next one."""
        finished = self._observe(sched, outputs, step_seconds)
        started = time.perf_counter()
        candidates = self._candidates(sched)
        k = self.adaptive.choose(len(candidates)) if candidates else 0
        wanted = [DraftRequest(r, n) for r in candidates if (n := self._cap(r, k)) > 0]
        wanted, drafts = self._propose(sched, wanted)
        for w, draft in zip(wanted, drafts, strict=True):
            self._store(w, draft)
        if finished:
            self.proposer.release(finished)
        self._last = (len(candidates), k, time.perf_counter() - started)

    def _propose(self, sched: SchedulerOutput, wanted: list[DraftRequest]
                 ) -> tuple[list[DraftRequest], list[Draft]]:
        """The proposer's drafts. With `ngram_first`, a request whose text has an n-gram
        match takes that match's drafts and the proposer sees only the others (it still sees
        every step, to follow the target); lookup costs nothing to propose, so whenever the
        controller drafts at all (k >= 1) a match may fill all num_speculative_tokens slots,
        while k bounds what the model proposes (its cost grows with k)."""
        if not self._lookup:
            return wanted, self.proposer.propose(sched, wanted)
        c = self.config
        full = [DraftRequest(w.request, self._cap(w.request, c.num_speculative_tokens))
                for w in wanted]
        found = [propose_ngram(np.asarray(w.request.all_token_ids), w.max_drafts, c.ngram_min,
                               c.ngram_max) for w in full]
        rest = iter(self.proposer.propose(sched, [w for w, f in zip(wanted, found, strict=True)
                                                  if not f]))
        drafts = [Draft(f) if f else next(rest) for f in found]
        return [lf if f else w for w, lf, f in zip(wanted, full, found, strict=True)], drafts

    def _candidates(self, sched: SchedulerOutput) -> list[Request]:
        out = []
        for item in sched.scheduled:
            request = self.scheduler.requests.get(item.request_id)
            if item.samples and request is not None and request.status == RequestStatus.RUNNING:
                out.append(request)
        return out

    def _cap(self, request: Request, k: int) -> int:
        """Drafts never past max_tokens (one slot stays for the bonus) or max_model_len."""
        k = min(k, self.max_model_len - request.num_tokens)
        if request.params.max_tokens is not None:
            k = min(k, request.params.max_tokens - request.num_output_tokens - 1)
        return max(0, k)

    def _store(self, wanted: DraftRequest, draft: Draft) -> None:
        request, tokens = wanted.request, draft.token_ids[:wanted.max_drafts]
        if tokens and self.draft_filter is not None:
            tokens = tokens[:self.draft_filter(request, tokens)]
        request.spec_token_ids = tokens
        request.spec_draft_probs = (draft.probs[:len(tokens)]
                                    if tokens and draft.probs is not None else None)
        self._asked[request.request_id] = (wanted.max_drafts, len(tokens))

    def _observe(self, sched: SchedulerOutput, outputs: list[EngineCoreOutput],
                 step_seconds: float) -> list[str]:
        """Feed acceptance and cost to the controller; returns the finished request ids."""
        finished = []
        for out in outputs:
            asked = self._asked.pop(out.request_id, None)
            if asked is not None and (out.new_token_ids or out.num_draft_tokens):
                num_asked = asked[0] if out.num_draft_tokens == asked[1] else out.num_draft_tokens
                self.adaptive.observe_acceptance(num_asked, out.num_accepted_tokens)
            if out.num_draft_tokens:
                self.stats.num_draft_tokens += out.num_draft_tokens
                self.stats.num_accepted_tokens += out.num_accepted_tokens
                self.stats.num_verify_steps += 1
            if out.finished:
                finished.append(out.request_id)
        for rid in finished:
            self._asked.pop(rid, None)
        if self._last is not None and _decode_only(sched, self._last[0]):
            batch, k, propose_seconds = self._last
            self.adaptive.observe_cost(batch, k, step_seconds + propose_seconds)
        return finished


def _decode_only(sched: SchedulerOutput, batch: int) -> bool:
    """Whether the step was the decode step the last decision planned (no prefill mixed in)."""
    return len(sched.scheduled) == batch and all(
        item.samples and len(item.token_ids) == 1 + item.num_draft_tokens
        for item in sched.scheduled)


def build_speculator(config: SpeculativeConfig, engine) -> Speculator:
    """The speculator for an EngineCore (reads its runner, configs and scheduler)."""
    ec = engine.config
    ctx = ProposerContext(target=engine.runner, model_path=engine.model_path, model=ec.model,
                          cache=ec.cache, scheduler=ec.scheduler, parallel=ec.parallel,
                          max_model_len=engine.max_model_len,
                          eos_token_ids=engine.eos_token_ids)
    return Speculator(config, ctx, engine.scheduler)
