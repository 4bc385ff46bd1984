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
     worth less than the model's goes to the model after all);
  4. each guess passes `draft_filter`, the seam for structured output (a grammar keeps the
     drafts it accepts; a request with a grammar gets a tree's main chain only), and lands in
     `request.spec_token_ids` (and `spec_draft_probs`, `spec_parents` for a tree), where the
     scheduler picks it up as extra query tokens.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from kiln.config import SpeculativeConfig
from kiln.engine.contract import EngineCoreOutput
from kiln.engine.request import Request, RequestStatus
from kiln.engine.scheduler import Scheduler, SchedulerOutput
from kiln.speculative.adaptive import AdaptiveK, TreeChoice
from kiln.speculative.ngram import RequestIndexes
from kiln.speculative.proposer import (
    Draft,
    DraftRequest,
    DraftTrie,
    ProposerContext,
    build_proposer,
)

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
        # trees: with adaptive speculation, tree steps get controllers of their own (a tree
        # accepts more than a chain and costs more) and `shape` picks trees or chains
        self.shape: TreeChoice | None = None
        self._trees: tuple[AdaptiveK, AdaptiveK | None] = (self.adaptive, self.lookup)
        if config.tree_width > 1 and config.adaptive:
            self.shape = TreeChoice()
            self._trees = (self._controller(), self._controller() if self.lookup else None)
            for controller in self._trees:
                if controller is not None:
                    controller.share_baseline(self.adaptive)
        self.draft_filter: DraftFilter | None = None
        self.stats = SpecStats()
        # request -> (drafts asked, proposed, the controller whose k it was)
        self._asked: dict[str, tuple[int, int, AdaptiveK]] = {}
        self._source: dict[int, str] = {}  # controller -> its drafts' source
        for model, lookup in ((self.adaptive, self.lookup), self._trees):
            self._source[id(model)] = config.method
            if lookup is not None:
                self._source[id(lookup)] = "ngram"
        self._controllers = list({id(c): c for c in (self.adaptive, self.lookup, *self._trees)
                                  if c is not None}.values())  # each once
        self._last: tuple[int, AdaptiveK, int, float, bool | None] | None = None  # (batch,
        # controller, k, propose seconds, tree step or not (None: trees not allowed)) of
        # the step the last round planned
        # ngram_first: lookup's record by the length of the suffix it matched, n ->
        # [verify steps, accepted drafts] (decayed like AdaptiveK's counts): one-token matches
        # are right far less often than four-token ones, and on prose less than a head
        self._by_match: dict[int, list[float]] = {}
        self._match_of: dict[str, int] = {}  # request -> its lookup drafts' match length
        # ...and each request's own [verifications, accepted drafts, what `_by_match`
        # expected of them] (decayed like AdaptiveK's request records): the record by length
        # is learned over all traffic, so after a change of traffic (code, then prose) it
        # promises what the old traffic's matches made; a request's own lookup steps scale it
        self._lookup_of: dict[str, list[float]] = {}
        # each request's tokens, for lookup (n-gram's own when it is the proposer)
        self._indexes: RequestIndexes = getattr(self.proposer, "indexes", RequestIndexes())

    def _controller(self) -> AdaptiveK:
        c = self.config
        return AdaptiveK(c.num_speculative_tokens, c.adaptive, c.max_batch_size)

    def after_step(self, sched: SchedulerOutput, outputs: list[EngineCoreOutput],
                   step_seconds: float) -> None:
        """Measure the step that ran, then set the drafts of the next one."""
        finished = self._observe(sched, outputs, step_seconds)
        started = time.perf_counter()
        candidates = self._candidates(sched)
        batch = len(candidates)
        tree = self._tree_step(batch)
        width = self.config.tree_width if tree else 1
        model, lookup = self._trees if tree else (self.adaptive, self.lookup)
        # a draining batch (no request waits for a slot: the end of an offline batch) lasts
        # as long as its slowest request; drafting is judged by that (AdaptiveK.choose)
        left = ({r.request_id: self._tokens_left(r) for r in candidates}
                if batch > 1 and not self.scheduler.num_waiting else None)
        if lookup is None:
            drafting = candidates
            if self.config.method == "ngram":  # lookup drafts only where the text has a match
                c = self.config
                drafting = [r for r in candidates
                            if self._indexes.of(r).match(1, c.ngram_min, c.ngram_max)[1]]
            k = model.choose(batch, [r.request_id for r in drafting], left) if drafting else 0
            wanted = [DraftRequest(r, n, width) for r in drafting
                      if (n := self._cap(r, k)) > 0]
            drafts = self.proposer.propose(sched, wanted)
            sources, planned = [model] * len(wanted), (model, k)
        else:
            wanted, drafts, sources, planned = self._propose_lookup_first(
                sched, batch, candidates, width, model, lookup, left)
        for w, draft, source in zip(wanted, drafts, sources, strict=True):
            self._store(w, draft, source)
        if finished:
            self.proposer.release(finished)
        self._indexes.release(finished + sched.finished_ids)  # aborted ones too
        self._forget(sched.finished_ids)  # aborted ones' records (finished ones are gone)
        self._last = (batch, *planned, time.perf_counter() - started, tree)

    def _tokens_left(self, request: Request) -> int:
        """Tokens the request may still make: by max_tokens, else what the context holds."""
        room = self.max_model_len - request.num_tokens
        if request.params.max_tokens is None:
            return room
        return min(room, request.params.max_tokens - request.num_output_tokens)

    def _propose_lookup_first(self, sched: SchedulerOutput, batch: int,
                              candidates: list[Request], width: int, model: AdaptiveK,
                              lookup: AdaptiveK, left: dict[str, int] | None):
        """`ngram_first`: a request whose text has an n-gram match takes that match's drafts
        (up to the lookup controller's k) unless matches of its length have paid less than
        the proposer's drafts promise (`_lookup_pays`) and the proposer drafts this step;
        the proposer drafts for the others (up to its own k; it still sees every step, to
        follow the target). `batch`: the sequences decoding; `left`: tokens left per
        request in a draining batch. Returns the wanted drafts, the drafts, each one's
        controller, and (controller, k) the step's cost is booked to: the proposer's when it
        drafted (its time is in the step), else lookup's."""
        found = [self._lookup(r, width) for r in candidates]
        # without adaptive speculation (k fixed, costs not weighed) the more often right
        # source drafts, and in a tree step that is the model's tree: a match passed over
        # joins it, its first continuation whole (`_merge`), so the tree is right wherever
        # lookup's chain is and often where it is not (k = 3 forced, 32 prompts: prose 2.02
        # -> 2.07 accepted at 2% less speed, code 2.14 -> 2.16 at the same speed;
        # see docs/decisions/0008)
        weigh = width == 1 or model.enabled
        pays = [bool(f.token_ids) and weigh
                and self._lookup_pays(batch, n, r.request_id, model, lookup)
                for r, (f, n) in zip(candidates, found, strict=True)]
        rest = [r for r, p in zip(candidates, pays, strict=True) if not p]
        k_model = model.choose(batch, [r.request_id for r in rest], left) if rest else 0
        if k_model and len(rest) < batch:
            # the model drafts this step anyway, so the step costs what a model step costs
            # whatever lookup drafts: a match stays with lookup only where it promises at least
            # the tokens the model's k drafts do (on prose at batch 2, routing such matches by
            # their cheaper lookup-only steps cost a tenth of the speed-up; measured against
            # the smaller k_model the controller picks there, the gain was lost again;
            # see docs/decisions/0008)
            pays = [p and self._lookup_expected(n, r.request_id) >= model.expected_tokens(
                        self.config.num_speculative_tokens, [r.request_id])
                    for r, (_, n), p in zip(candidates, found, pays, strict=True)]
            rest = [r for r, p in zip(candidates, pays, strict=True) if not p]
        # a match passed over for the model still drafts in a step where the model does not
        matched = [(r, f, n) for r, (f, n), p in zip(candidates, found, pays, strict=True)
                   if f.token_ids and (p or not k_model)]
        k_lookup = (lookup.choose(batch, [r.request_id for r, _, _ in matched], left)
                    if matched else 0)
        to_model = [DraftRequest(r, n, width) for r in rest
                    if (n := self._cap(r, k_model)) > 0]
        model_drafts = self.proposer.propose(sched, to_model)
        if width > 1:  # a tree step: a match passed over for the model joins its tree
            passed = {r.request_id: f for r, (f, _), p in zip(candidates, found, pays,
                                                              strict=True) if not p}
            model_drafts = [self._merge(passed.get(w.request.request_id), d, w.max_drafts)
                            for w, d in zip(to_model, model_drafts, strict=True)]
        to_lookup = [DraftRequest(r, self._cap(r, k_lookup)) for r, _, _ in matched if k_lookup]
        wanted = to_model + to_lookup
        drafts = model_drafts + [f for _, f, _ in matched if k_lookup]
        self._match_of.update((r.request_id, n) for r, _, n in matched if k_lookup)
        for (f, n), p in zip(found, pays, strict=True):
            # passed over: old evidence fades toward the prior, so lookup gets it back in time
            if f.token_ids and not p and k_model and (record := self._by_match.get(n)):
                record[0] *= lookup.acceptance_decay
                record[1] *= lookup.acceptance_decay
        sources = [model] * len(to_model) + [lookup] * len(to_lookup)
        planned = (model, k_model) if to_model or not to_lookup else (lookup, k_lookup)
        return wanted, drafts, sources, planned

    def _merge(self, lookup: Draft | None, model: Draft, depth: int) -> Draft:
        """One tree holding lookup's first continuation, the model's drafts, then lookup's
        other continuations, merged by common prefix (a full tree drops what comes last):
        verified in one forward, whichever is right is accepted. Lookup's first continuation
        goes whole before the model's tree: on code it was right more often than the model's
        least likely nodes it displaces (k = 3 forced, 10 drafts in all: 1.90 -> 2.00
        accepted per verify step; see docs/decisions/0005). With
        `tree_min_prob` lookup's other continuations stay out: replayed on recorded prose
        trees they brought fewer accepted drafts per draft verified than the head's nodes
        near the floor (see docs/decisions/0006)."""
        if lookup is None or not lookup.token_ids:
            return model
        lookup = lookup.limit(depth, self.config.tree_size)
        tree = DraftTrie(self.config.tree_size)
        tree.add_draft(lookup.main_chain())
        tree.add_draft(model)  # already at most `depth` deep
        by_probability = self.config.method == "head" and self.config.tree_min_prob
        if not by_probability:  # a tree by probability holds only what clears its floor
            tree.add_draft(lookup)
        return tree.draft()

    def _tree_step(self, batch: int) -> bool | None:
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

    def _lookup_pays(self, batch: int, match_length: int, request_id: str, model: AdaptiveK,
                     lookup: AdaptiveK) -> bool:
        """Whether a request whose text ends in an n-gram match of this length takes lookup's
        drafts rather than the model's: each source's expected tokens per step (1 + accepted
        drafts; the model's by the request's own record) per second of its measured step
        cost (the model's includes its drafting).
        A length not yet tried goes to lookup (its prior is k accepted); without adaptive
        speculation (k fixed, costs not weighed) the more often right source drafts."""
        k = self.config.num_speculative_tokens
        expected = self._lookup_expected(match_length, request_id)
        promised = model.expected_tokens(k, [request_id])
        if model.enabled:
            lookup_cost, model_cost = lookup.cost(batch, k), model.cost(batch, k)
            if lookup_cost and model_cost:
                return expected / lookup_cost >= promised / model_cost
        return expected >= promised

    def _lookup_expected(self, match_length: int, request_id: str | None = None) -> float:
        """Tokens per step lookup's drafts from a match of this length have made (1 +
        accepted drafts), a length not yet tried counting as k accepted; for a request,
        scaled by what its own lookup steps made of what the record expected of them (the
        record's scale, worth `request_prior` of its steps, as the prior)."""
        verifies, accepted = self._by_match.get(match_length, (0.0, 0.0))
        expected = (accepted + self.config.num_speculative_tokens) / (verifies + 1.0)
        own = self._lookup_of.get(request_id) if request_id is not None else None
        if own is not None and own[0] > 0:
            steps, made, promised = own
            prior = self.lookup.request_prior * promised / steps  # in accepted drafts
            expected *= (made + prior) / (promised + prior)
        return 1.0 + expected

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

    def _store(self, wanted: DraftRequest, draft: Draft, source: AdaptiveK) -> None:
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
        self._asked[request.request_id] = (wanted.max_drafts, len(tokens), source)

    def _observe(self, sched: SchedulerOutput, outputs: list[EngineCoreOutput],
                 step_seconds: float) -> list[str]:
        """Feed acceptance and cost to the controller; returns the finished request ids."""
        finished = []
        for out in outputs:
            asked = self._asked.pop(out.request_id, None)
            if asked is not None and (out.new_token_ids or out.num_draft_tokens):
                num_asked = (asked[0] if out.num_draft_tokens == asked[1]
                             else min(asked[0], out.num_draft_tokens))
                asked[2].observe_acceptance(num_asked, out.num_accepted_tokens, out.request_id)
            if asked is not None and out.num_draft_tokens:
                out.draft_source = self._source[id(asked[2])]
            if (n := self._match_of.pop(out.request_id, 0)) and (out.new_token_ids
                                                                 or out.num_draft_tokens):
                promised = self._lookup_expected(n) - 1.0  # before this step counts
                own = self._lookup_of.setdefault(out.request_id, [0.0, 0.0, 0.0])
                own[:] = [c * self.lookup.request_decay + x for c, x in
                          zip(own, (1.0, out.num_accepted_tokens, promised), strict=True)]
                record = self._by_match.setdefault(n, [0.0, 0.0])
                decay = self.lookup.acceptance_decay
                record[0] = record[0] * decay + 1.0
                record[1] = record[1] * decay + out.num_accepted_tokens
            if out.num_draft_tokens:
                self.stats.num_draft_tokens += out.num_draft_tokens
                self.stats.num_accepted_tokens += out.num_accepted_tokens
                self.stats.num_verify_steps += 1
            if out.finished:
                finished.append(out.request_id)
        self._forget(finished)
        if self._last is not None and _decode_only(sched, self._last[0]):
            batch, controller, k, propose_seconds, tree = self._last
            seconds = step_seconds + propose_seconds
            controller.observe_cost(batch, k, seconds)
            if tree is not None and self.shape is not None and batch:
                base = self.adaptive.cost(batch, 0)
                if base:
                    made = sum(len(out.new_token_ids) for out in outputs)
                    self.shape.observe(tree, made / batch, seconds / batch / base)
        return finished


    def _forget(self, request_ids: list[str]) -> None:
        """Drop ended requests' records (the controllers' too)."""
        for rid in request_ids:
            self._asked.pop(rid, None)
            self._match_of.pop(rid, None)
            self._lookup_of.pop(rid, None)
        if request_ids:
            for controller in self._controllers:
                controller.forget(request_ids)


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
