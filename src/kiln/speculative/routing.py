"""`ngram_first`'s routing: per request and step, whether an n-gram match's drafts go alone,
join the model's tree, or the model drafts.

With a draft model or head and `ngram_first`, a request whose text ends in an n-gram match may
take lookup's drafts (free to propose, and on text that repeats itself right far more often
than a small model) instead of the model's. Whether that pays depends on the match: one-token
matches are right far less often than four-token ones, and on prose less often than a head. So
lookup keeps a record by match length (`MatchRecord`: verify steps and accepted drafts, decayed
like `AdaptiveK`'s counts; a length not yet tried counts as k accepted). That record is learned
over all traffic, so after a change of traffic (code, then prose) it promises what the old
traffic's matches made; each request scales it by its own lookup steps (`RequestRecord`: what
they made of what the record expected of them).

A step is decided in two calls around the model's controller choosing its k:

  1. `preferred(step)`: the matches whose drafts alone would pay: each source's expected tokens
     per step (1 + accepted drafts) per second of its measured step cost (`prefers_lookup`).
     Without adaptive speculation (k fixed, costs not weighed) the more often right source
     drafts, and in a tree step that is the model's tree with the match's first continuation
     in it (`join`): none is preferred there.
  2. `route(step, preferred, model_drafts)`: where the model drafts anyway (for the requests
     not preferred), the step costs what a model step costs whatever lookup drafts, so a match
     stays with lookup only where it promises at least the tokens the model's drafts do; where
     the model does not draft, every match drafts with lookup.

The records change only through `drafting`, `observe`, `fade_passed_over` and `forget`, all
keyed by request id; everything else is a pure function of them and its arguments.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from kiln.speculative.proposer import Draft, DraftTrie


@dataclass(frozen=True, slots=True)
class RoutingParams:
    k: int  # drafts a match offers (num_speculative_tokens); an untried length: k accepted
    tree_size: int  # drafts a joined tree holds at most
    lookup_branches: bool = True  # a joined tree keeps lookup's other continuations (False
    # for a head's tree by probability: it holds only what clears its floor)
    decay: float = 0.995  # per verify step, old evidence of a length fades (AdaptiveK's)
    request_decay: float = 0.95  # per verify step, a request's own evidence fades faster
    request_prior: float = 2.0  # the record by length counts as this many of a request's steps


@dataclass(frozen=True, slots=True)
class MatchRecord:
    """What lookup's drafts from matches of one length made (decayed counts)."""

    verifies: float = 0.0  # verify steps
    accepted: float = 0.0  # drafts accepted in them

    def expected_accepted(self, k: int) -> float:
        """Accepted drafts per verify step, with k accepted in one step as the prior."""
        return (self.accepted + k) / (self.verifies + 1.0)

    def verified(self, accepted: int, decay: float) -> MatchRecord:
        return MatchRecord(self.verifies * decay + 1.0, self.accepted * decay + accepted)

    def faded(self, decay: float) -> MatchRecord:
        """Passed over for the model: old evidence fades toward the prior, so lookup gets the
        length back in time."""
        return MatchRecord(self.verifies * decay, self.accepted * decay)


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One request's own lookup steps (decayed counts)."""

    steps: float = 0.0  # verify steps of lookup's drafts
    accepted: float = 0.0  # drafts accepted in them
    promised: float = 0.0  # accepted drafts the record by length expected of them

    def verified(self, accepted: int, promised: float, decay: float) -> RequestRecord:
        return RequestRecord(self.steps * decay + 1.0, self.accepted * decay + accepted,
                             self.promised * decay + promised)

    def scale(self, request_prior: float) -> float:
        """What the request's steps made of what the record promised, the record's own scale
        (worth `request_prior` of its steps) as the prior."""
        prior = request_prior * self.promised / self.steps  # in accepted drafts
        return (self.accepted + prior) / (self.promised + prior)


@dataclass(frozen=True, slots=True)
class LookupMatch:
    """A request whose text ends in an n-gram match that has drafts."""

    request_id: str
    length: int  # tokens of the suffix matched (>= 1)
    model_tokens: float  # tokens per step (1 + accepted) the model's k drafts promise it


@dataclass(frozen=True, slots=True)
class StepCosts:
    """Measured seconds per sequence of a step at this batch verifying k drafts of a source
    (the model's includes its drafting)."""

    lookup: float
    model: float


@dataclass(frozen=True, slots=True)
class RoutingStep:
    """What routing weighs in one step."""

    matches: tuple[LookupMatch, ...]  # in the order of the step's requests
    tree: bool  # the model drafts trees this step (a passed-over match joins them)
    adaptive: bool  # k chosen by measured cost; False: k fixed, costs not weighed
    costs: StepCosts | None = None  # None: not both measured yet


@dataclass(frozen=True, slots=True)
class Routing:
    """One step's decision: `lookup`'s matches draft alone (under lookup's k); the model drafts
    for every other request, `passed_over` its requests that had a match (in a tree step, the
    match joins the model's tree)."""

    lookup: tuple[LookupMatch, ...]
    passed_over: tuple[LookupMatch, ...]


class LookupRouting:
    """The routing policy and its records (see the module docstring)."""

    def __init__(self, params: RoutingParams,
                 by_length: Mapping[int, MatchRecord] | None = None):
        """`by_length`: a record learned elsewhere to start from (empty: every length untried)."""
        self.params = params
        self._by_length: dict[int, MatchRecord] = dict(by_length or {})
        self._own: dict[str, RequestRecord] = {}  # request id -> its own lookup steps
        self._drafting: dict[str, int] = {}  # request id -> the length lookup drafted from

    # -- reading the records --------------------------------------------------------------

    @property
    def by_length(self) -> Mapping[int, MatchRecord]:
        return dict(self._by_length)

    def request_record(self, request_id: str) -> RequestRecord | None:
        return self._own.get(request_id)

    @property
    def tracked(self) -> frozenset[str]:
        """Requests with any state here (awaiting verification, or a record of their own)."""
        return frozenset(self._own) | frozenset(self._drafting)

    def expected_tokens(self, length: int, request_id: str | None = None) -> float:
        """Tokens per step (1 + accepted drafts) lookup's drafts from a match of this length
        have made; for a request, scaled by its own lookup steps."""
        expected = self._by_length.get(length, MatchRecord()).expected_accepted(self.params.k)
        own = self._own.get(request_id) if request_id is not None else None
        if own is not None and own.steps > 0:
            expected *= own.scale(self.params.request_prior)
        return 1.0 + expected

    # -- decisions ------------------------------------------------------------------------

    def prefers_lookup(self, match: LookupMatch, costs: StepCosts | None) -> bool:
        """Whether the match's drafts alone pay more than the model's: expected tokens per
        second of each source's step (`costs`), else (None: not weighed) tokens alone."""
        expected = self.expected_tokens(match.length, match.request_id)
        if costs is not None:
            return expected / costs.lookup >= match.model_tokens / costs.model
        return expected >= match.model_tokens

    def preferred(self, step: RoutingStep) -> frozenset[str]:
        """The requests whose match drafts alone unless the model drafts this step anyway."""
        if step.tree and not step.adaptive:  # the model's tree, the match joined, is right more
            # often than the match alone (k = 3 forced, 32 prompts: prose 2.02 -> 2.07
            # accepted at 2% less speed, code 2.14 -> 2.16 at the same speed; see
            # docs/decisions/0008)
            return frozenset()
        costs = step.costs if step.adaptive else None
        return frozenset(m.request_id for m in step.matches if self.prefers_lookup(m, costs))

    def route(self, step: RoutingStep, preferred: frozenset[str], model_drafts: bool) -> Routing:
        """The step's decision, once the model's controller chose its k for the requests not
        `preferred` (`model_drafts`: that k is not 0)."""
        if not model_drafts:  # a match passed over for the model still drafts where it does not
            return Routing(step.matches, ())
        # a model step costs what it costs whatever lookup drafts: a match stays only where
        # it makes at least the model's tokens (on prose at batch 2, routing by the cheaper
        # lookup-only steps' cost there cost a tenth of the speed-up; measured against the
        # smaller k the controller picks there, the gain was lost again; see
        # docs/decisions/0008)
        alone = tuple(m for m in step.matches if m.request_id in preferred
                      and self.expected_tokens(m.length, m.request_id) >= m.model_tokens)
        kept = {m.request_id for m in alone}
        return Routing(alone, tuple(m for m in step.matches if m.request_id not in kept))

    def join(self, lookup: Draft | None, model: Draft, depth: int) -> Draft:
        """One tree holding lookup's first continuation, the model's drafts, then lookup's
        other continuations, merged by common prefix (a full tree drops what comes last):
        verified in one forward, whichever is right is accepted. Lookup's first continuation
        goes whole before the model's tree: on code it was right more often than the model's
        least likely nodes it displaces (k = 3 forced, 10 drafts in all: 1.90 -> 2.00
        accepted per verify step; see docs/decisions/0005). Without
        `lookup_branches` (a head's tree by probability, `tree_min_prob`) lookup's other
        continuations stay out: replayed on recorded prose trees they brought fewer accepted
        drafts per draft verified than the head's nodes near the floor (see
        docs/decisions/0006)."""
        if lookup is None or not lookup.token_ids:
            return model
        size = self.params.tree_size
        lookup = lookup.limit(depth, size)
        tree = DraftTrie(size)
        tree.add_draft(lookup.main_chain())
        tree.add_draft(model)  # already at most `depth` deep
        if self.params.lookup_branches:
            tree.add_draft(lookup)
        return tree.draft()

    # -- records --------------------------------------------------------------------------

    def drafting(self, matches: Iterable[LookupMatch]) -> None:
        """Lookup drafts for these matches this step (their outcome comes to `observe`)."""
        self._drafting.update((m.request_id, m.length) for m in matches)

    def fade_passed_over(self, routing: Routing) -> None:
        """Each match passed over for the model fades its length's record (once per match)."""
        for m in routing.passed_over:
            if (record := self._by_length.get(m.length)) is not None:
                self._by_length[m.length] = record.faded(self.params.decay)

    def observe(self, request_id: str, num_accepted: int, verified: bool) -> None:
        """A request's outcome of the step that ran (every output of it): where lookup drafted
        for it and the step verified (`verified`: it made tokens or verified drafts), its
        length's record and its own count the accepted drafts."""
        length = self._drafting.pop(request_id, None)
        if length is None or not verified:
            return
        p = self.params
        promised = self.expected_tokens(length) - 1.0  # before this step counts
        own = self._own.get(request_id, RequestRecord())
        self._own[request_id] = own.verified(num_accepted, promised, p.request_decay)
        record = self._by_length.get(length, MatchRecord())
        self._by_length[length] = record.verified(num_accepted, p.decay)

    def forget(self, request_ids: Iterable[str]) -> None:
        """Drop ended (finished or aborted) requests' state."""
        for rid in request_ids:
            self._drafting.pop(rid, None)
            self._own.pop(rid, None)
