"""The engine side of speculative decoding: after each step, drafts for the running requests.

`EngineCore` owns one `Speculator` when `EngineConfig.speculative` is set and calls
`after_step` once per step, after `Scheduler.update`, so requests hold verified tokens only:

  1. the adaptive controller gets the step's measured cost and each request's acceptance;
  2. it picks k for the next step (0 = no drafts this time), judging acceptance by the
     requests it would draft for (their own records, the global estimate as the prior);
  3. the proposer guesses up to k tokens for each running request that just sampled, capped
     so a draft never sits past `max_tokens` (the bonus token needs the last slot) or
     `max_model_len` (with `ngram_first`, requests whose text has an n-gram match take its
     drafts instead, with a k of their own: on text that repeats itself, lookup beats a
     small model; with adaptive speculation, a match of a length whose drafts have been
     worth less than the model's goes to the model after all: kiln.speculative.routing);
  4. each guess passes `draft_filter`, the seam for structured output (a grammar keeps the
     drafts it accepts; a request with a grammar gets a tree's main chain only), and lands in
     `request.spec_token_ids` (and `spec_draft_probs`, `spec_parents` for a tree), where the
     scheduler picks it up as extra query tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

from kiln.config_speculative import SpeculativeConfig
from kiln.engine.contract import EngineCoreOutput
from kiln.engine.request import Request, RequestStatus
from kiln.engine.scheduler import Scheduler, SchedulerOutput
from kiln.speculative.adaptive import AdaptiveK, TreeChoice
from kiln.speculative.ngram import RequestIndexes
from kiln.speculative.proposer import (
    Draft,
    DraftRequest,
    ProposerContext,
    build_proposer,
)
from kiln.speculative.routing import (
    LookupMatch,
    LookupRouting,
    RoutingParams,
    RoutingStep,
    StepCosts,
)


class DraftFilter(Protocol):
    """The structured-output seam (kiln.structured.hooks.StructuredHooks.draft_filter): how
    many leading drafts of a chain the request's grammar accepts. It may read the request
    and must not mutate it or the drafts."""

    def __call__(self, request: Request, drafts: list[int]) -> int: ...


@dataclass
class SpecStats:
    """Totals since the engine started (for /metrics)."""

    num_draft_tokens: int = 0  # drafts verified
    num_accepted_tokens: int = 0  # of which were accepted
    num_verify_steps: int = 0  # request-steps that verified at least one draft

    @property
    def mean_accepted_length(self) -> float:
        return self.num_accepted_tokens / self.num_verify_steps if self.num_verify_steps else 0.0


@dataclass(frozen=True, eq=False, slots=True)
class DraftSource:
    """A source of drafts: the name metrics count its drafts under ("ngram" for lookup, else
    the method) and the controller choosing its k."""

    name: str
    controller: AdaptiveK


@dataclass(frozen=True, slots=True)
class DraftSources:
    """The sources of one step shape (chains, or trees with controllers of their own)."""

    model: DraftSource
    lookup: DraftSource | None  # None: no `ngram_first` beside a model


@dataclass(frozen=True, slots=True)
class _Asked:
    """What a request was asked to verify: drafts asked for and proposed, and by whom."""

    max_drafts: int
    proposed: int
    source: DraftSource


@dataclass(frozen=True, slots=True)
class _Planned:
    """The decode step the last round planned: its cost is booked to `source`'s k arm."""

    batch: int
    source: DraftSource
    k: int
    propose_seconds: float
    tree: bool | None  # a tree step or not; None: trees not allowed


@dataclass(frozen=True, slots=True)
class _StepDrafts:
    """One round's drafts: per wanted request, its draft and source; `booked`/`k`: the
    source and k the step's cost is booked to."""

    wanted: list[DraftRequest]
    drafts: list[Draft]
    sources: list[DraftSource]
    booked: DraftSource
    k: int


class Speculator:
    def __init__(self, config: SpeculativeConfig, ctx: ProposerContext, scheduler: Scheduler):
        self.config = config = config.resolved()
        self.scheduler = scheduler
        self.max_model_len = ctx.max_model_len
        self.proposer = build_proposer(config, ctx)
        self.adaptive = self._controller()  # k of the proposer's drafts
        # with ngram_first, lookup's drafts get their own k: they cost nothing to propose
        # and are accepted far more often than a small model's where there is a match, so
        # one k for both would draft too little from one source or too much from the other
        self.lookup: AdaptiveK | None = None
        if config.ngram_first and config.method != "ngram":
            self.lookup = self._controller()
            self.lookup.share_baseline(self.adaptive)
        self.chains = self._sources(self.adaptive, self.lookup)
        # trees: with adaptive speculation, tree steps get controllers of their own (a tree
        # accepts more than a chain and costs more) and `shape` picks trees or chains
        self.shape: TreeChoice | None = None
        self.trees = self.chains
        if config.tree_width > 1 and config.adaptive:
            self.shape = TreeChoice()
            self.trees = self._sources(self._controller(),
                                       self._controller() if self.lookup else None)
            for source in (self.trees.model, self.trees.lookup):
                if source is not None:
                    source.controller.share_baseline(self.adaptive)
        self.draft_filter: DraftFilter | None = None
        self.stats = SpecStats()
        # ngram_first: which source drafts for a request with a match (kiln.speculative.routing)
        self.routing: LookupRouting | None = None
        if self.lookup is not None:
            self.routing = LookupRouting(RoutingParams(
                k=config.num_speculative_tokens, tree_size=config.tree_size,
                lookup_branches=not (config.method == "head" and config.tree_min_prob),
                decay=self.lookup.acceptance_decay, request_decay=self.lookup.request_decay,
                request_prior=self.lookup.request_prior))
        self._asked: dict[str, _Asked] = {}  # request id -> what it was asked to verify
        self._last: _Planned | None = None
        # each request's tokens, for lookup (n-gram's own when it is the proposer)
        self._indexes: RequestIndexes = getattr(self.proposer, "indexes", RequestIndexes())

    def _controller(self) -> AdaptiveK:
        c = self.config
        return AdaptiveK(c.num_speculative_tokens, c.adaptive, c.max_batch_size)

    def _sources(self, model: AdaptiveK, lookup: AdaptiveK | None) -> DraftSources:
        return DraftSources(DraftSource(self.config.method, model),
                            None if lookup is None else DraftSource("ngram", lookup))

    @property
    def sources(self) -> list[DraftSource]:
        """Every source of drafts, each once."""
        out = [self.chains.model, self.chains.lookup, self.trees.model, self.trees.lookup]
        return [s for i, s in enumerate(out)
                if s is not None and all(s is not t for t in out[:i])]

    def after_step(self, sched: SchedulerOutput, outputs: list[EngineCoreOutput],
                   step_seconds: float) -> None:
        """Measure the step that ran, then set the drafts of the next one."""
        finished = self._observe(sched, outputs, step_seconds)
        started = time.perf_counter()
        candidates = self._candidates(sched)
        batch = len(candidates)
        tree = self.tree_step(batch)
        width = self.config.tree_width if tree else 1
        sources = self.trees if tree else self.chains
        # a draining batch (no request waits for a slot: the end of an offline batch) lasts
        # as long as its slowest request; drafting is judged by that (AdaptiveK.choose)
        left = ({r.request_id: tokens_left(r, self.max_model_len) for r in candidates}
                if batch > 1 and not self.scheduler.num_waiting else None)
        if sources.lookup is None:
            step = self._propose_model(sched, batch, candidates, width, sources.model, left)
        else:
            step = self._propose_lookup_first(sched, batch, candidates, width,
                                              sources.model, sources.lookup, left)
        for w, draft, source in zip(step.wanted, step.drafts, step.sources, strict=True):
            self._store(w, draft, source)
        if finished:
            self.proposer.release(finished)
        self._indexes.release(finished + sched.finished_ids)  # aborted ones too
        self._forget(sched.finished_ids)  # aborted ones' records (finished ones are gone)
        self._last = _Planned(batch, step.booked, step.k, time.perf_counter() - started, tree)

    def _propose_model(self, sched: SchedulerOutput, batch: int, candidates: list[Request],
                       width: int, model: DraftSource,
                       left: dict[str, int] | None) -> _StepDrafts:
        """The proposer drafts for every candidate (n-gram: those whose text has a match)."""
        drafting = candidates
        if self.config.method == "ngram":  # lookup drafts only where the text has a match
            c = self.config
            drafting = [r for r in candidates
                        if self._indexes.of(r).match(1, c.ngram_min, c.ngram_max)[1]]
        k = (model.controller.choose(batch, [r.request_id for r in drafting], left)
             if drafting else 0)
        wanted = [DraftRequest(r, n, width) for r in drafting if (n := self._cap(r, k)) > 0]
        drafts = self.proposer.propose(sched, wanted)
        return _StepDrafts(wanted, drafts, [model] * len(wanted), model, k)

    def _propose_lookup_first(self, sched: SchedulerOutput, batch: int,
                              candidates: list[Request], width: int, model: DraftSource,
                              lookup: DraftSource, left: dict[str, int] | None) -> _StepDrafts:
        """`ngram_first`: `routing` decides which requests with an n-gram match take that
        match's drafts (up to the lookup controller's k); the proposer drafts for the others
        (up to its own k; it still sees every step, to follow the target), a passed-over
        match joining its tree in a tree step. `batch`: the sequences decoding; `left`:
        tokens left per request in a draining batch. The step's cost is booked to the
        proposer when it drafted (its time is in the step), else to lookup."""
        found = {r.request_id: self._lookup(r, width) for r in candidates}
        step = self._routing_step(batch, found, width > 1, model.controller, lookup.controller)
        preferred = self.routing.preferred(step)
        rest = [r.request_id for r in candidates if r.request_id not in preferred]
        k_model = model.controller.choose(batch, rest, left) if rest else 0
        routing = self.routing.route(step, preferred, model_drafts=k_model > 0)
        alone = {m.request_id for m in routing.lookup}
        k_lookup = (lookup.controller.choose(batch, [m.request_id for m in routing.lookup], left)
                    if routing.lookup else 0)
        to_model = [DraftRequest(r, n, width) for r in candidates
                    if r.request_id not in alone and (n := self._cap(r, k_model)) > 0]
        model_drafts = self.proposer.propose(sched, to_model)
        if width > 1:  # a tree step: a match passed over for the model joins its tree
            joining = {m.request_id for m in routing.passed_over}
            model_drafts = [self.routing.join(found[w.request.request_id][0]
                                              if w.request.request_id in joining else None,
                                              d, w.max_drafts)
                            for w, d in zip(to_model, model_drafts, strict=True)]
        to_lookup = ([DraftRequest(r, self._cap(r, k_lookup)) for r in candidates
                      if r.request_id in alone] if k_lookup else [])
        if k_lookup:
            self.routing.drafting(routing.lookup)
        self.routing.fade_passed_over(routing)
        wanted = to_model + to_lookup
        drafts = model_drafts + [found[w.request.request_id][0] for w in to_lookup]
        sources = [model] * len(to_model) + [lookup] * len(to_lookup)
        if to_model or not to_lookup:
            return _StepDrafts(wanted, drafts, sources, model, k_model)
        return _StepDrafts(wanted, drafts, sources, lookup, k_lookup)

    def _routing_step(self, batch: int, found: dict[str, tuple[Draft, int]], tree: bool,
                      model: AdaptiveK, lookup: AdaptiveK) -> RoutingStep:
        """What routing weighs: the matches with drafts, what the model's k drafts promise
        each (by the request's own record), and both sources' measured step costs."""
        k = self.config.num_speculative_tokens
        matches = tuple(LookupMatch(rid, n, model.expected_tokens(k, [rid]))
                        for rid, (draft, n) in found.items() if draft.token_ids)
        costs = None
        if matches and model.enabled:
            lookup_cost, model_cost = lookup.cost(batch, k), model.cost(batch, k)
            if lookup_cost and model_cost:
                costs = StepCosts(lookup_cost, model_cost)
        return RoutingStep(matches, tree, model.enabled, costs)

    def tree_step(self, batch: int) -> bool | None:
        """Whether this step drafts trees (`tree_width` continuations per request): None
        where trees are not allowed (`tree_width` 1, no sequence or more than `tree_max_batch`
        decode), else True without adaptive speculation, else `shape`'s choice."""
        c = self.config
        if c.tree_width == 1 or not 0 < batch <= c.tree_max_batch:
            return None
        return True if self.shape is None else self.shape.choose()

    def _lookup(self, request: Request, width: int) -> tuple[Draft, int]:
        """Lookup's drafts for a request (a tree with width > 1) and the length of the
        suffix they matched (0: none)."""
        c, index = self.config, self._indexes.of(request)
        k = self._cap(request, c.num_speculative_tokens)
        if width > 1:
            return index.tree(k, c.ngram_min, c.ngram_max, width, c.tree_size)
        chain, n = index.match(k, c.ngram_min, c.ngram_max)
        return Draft(chain), n

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

    def _store(self, wanted: DraftRequest, draft: Draft, source: DraftSource) -> None:
        request = wanted.request
        if draft.parents is not None and (request.grammar is not None or draft.probs is not None):
            draft = draft.main_chain()  # grammar masks and q rows follow one chain
        draft = draft.limit(wanted.max_drafts,
                            min(self.config.tree_size, self.max_model_len - request.num_tokens))
        tokens = draft.token_ids
        if tokens and self.draft_filter is not None and draft.parents is None:
            tokens = tokens[:self.draft_filter(request, tokens)]
        request.spec_token_ids = tokens
        request.spec_draft_probs = (draft.probs[:len(tokens)]
                                    if tokens and draft.probs is not None else None)
        request.spec_parents = draft.parents if tokens else None
        self._asked[request.request_id] = _Asked(wanted.max_drafts, len(tokens), source)

    def _observe(self, sched: SchedulerOutput, outputs: list[EngineCoreOutput],
                 step_seconds: float) -> list[str]:
        """Feed acceptance and cost to the controllers and routing; returns the finished
        request ids."""
        finished = []
        for out in outputs:
            verified = bool(out.new_token_ids or out.num_draft_tokens)
            asked = self._asked.pop(out.request_id, None)
            if asked is not None and verified:
                num_asked = (asked.max_drafts if out.num_draft_tokens == asked.proposed
                             else min(asked.max_drafts, out.num_draft_tokens))
                asked.source.controller.observe_acceptance(num_asked, out.num_accepted_tokens,
                                                           out.request_id)
            if asked is not None and out.num_draft_tokens:
                out.draft_source = asked.source.name
            if self.routing is not None:
                self.routing.observe(out.request_id, out.num_accepted_tokens, verified)
            if out.num_draft_tokens:
                self.stats.num_draft_tokens += out.num_draft_tokens
                self.stats.num_accepted_tokens += out.num_accepted_tokens
                self.stats.num_verify_steps += 1
            if out.finished:
                finished.append(out.request_id)
        self._forget(finished)
        if self._last is not None and _decode_only(sched, self._last.batch):
            self._observe_cost(self._last, outputs, step_seconds)
        return finished

    def _observe_cost(self, last: _Planned, outputs: list[EngineCoreOutput],
                      step_seconds: float) -> None:
        seconds = step_seconds + last.propose_seconds
        last.source.controller.observe_cost(last.batch, last.k, seconds)
        if last.tree is not None and self.shape is not None and last.batch:
            base = self.adaptive.cost(last.batch, 0)
            if base:
                made = sum(len(out.new_token_ids) for out in outputs)
                self.shape.observe(last.tree, made / last.batch, seconds / last.batch / base)

    def _forget(self, request_ids: list[str]) -> None:
        """Drop ended requests' records (the controllers' and routing's too)."""
        for rid in request_ids:
            self._asked.pop(rid, None)
        if request_ids:
            if self.routing is not None:
                self.routing.forget(request_ids)
            for source in self.sources:
                source.controller.forget(request_ids)


def tokens_left(request: Request, max_model_len: int) -> int:
    """Tokens the request may still make: by max_tokens, else what the context holds."""
    room = max_model_len - request.num_tokens
    if request.params.max_tokens is None:
        return room
    return min(room, request.params.max_tokens - request.num_output_tokens)


def _decode_only(sched: SchedulerOutput, batch: int) -> bool:
    """Whether the step was the decode step the last decision planned (no prefill mixed in)."""
    return len(sched.scheduled) == batch and all(
        item.samples and len(item.token_ids) == 1 + item.num_draft_tokens
        for item in sched.scheduled)


def build_speculator(config: SpeculativeConfig, engine) -> Speculator:
    """The speculator for an EngineCore (reads its runner, configs and scheduler). The
    proposers must be registered first (kiln.assembly.register_plugins)."""
    ec = engine.config
    ctx = ProposerContext(target=engine.runner, model_path=engine.model_path, model=ec.model,
                          cache=ec.cache, scheduler=ec.scheduler, parallel=ec.parallel,
                          max_model_len=engine.max_model_len,
                          eos_token_ids=engine.eos_token_ids)
    return Speculator(config, ctx, engine.scheduler)
