"""ngram_first's routing policy (kiln.speculative.routing), alone: exact records and decisions.

Most tests use decay 1 (no fading) so every expected value is a small fraction:
an untried length with k = 3 makes 1 + 3 tokens per step, a record of (v verify steps, a
accepted) makes 1 + (a + 3) / (v + 1).
"""

from __future__ import annotations

import pytest

from kiln.speculative.proposer import Draft
from kiln.speculative.routing import (
    LookupMatch,
    LookupRouting,
    MatchRecord,
    RequestRecord,
    Routing,
    RoutingParams,
    RoutingStep,
    StepCosts,
)

EXACT = RoutingParams(k=3, tree_size=12, decay=1.0, request_decay=1.0, request_prior=2.0)


def chain_step(*matches: LookupMatch, costs: StepCosts | None = None,
               adaptive: bool = True) -> RoutingStep:
    return RoutingStep(matches, tree=False, adaptive=adaptive, costs=costs)


def test_an_untried_length_counts_as_k_accepted():
    routing = LookupRouting(EXACT)
    assert routing.expected_tokens(4) == 4.0
    assert routing.expected_tokens(4, "r") == 4.0  # no record of its own: the record alone
    assert routing.by_length == {} and routing.tracked == frozenset()


def test_verified_lookup_steps_count_in_the_length_and_the_request_record():
    routing = LookupRouting(RoutingParams(k=3, tree_size=12, decay=0.5, request_decay=0.25))
    routing.drafting([LookupMatch("r", 4, 2.0)])
    assert routing.tracked == {"r"}
    routing.observe("r", 2, verified=True)
    # before the step counted, the untried length promised k = 3 accepted
    assert routing.by_length == {4: MatchRecord(verifies=1.0, accepted=2.0)}
    assert routing.request_record("r") == RequestRecord(steps=1.0, accepted=2.0, promised=3.0)
    routing.drafting([LookupMatch("r", 4, 2.0)])
    routing.observe("r", 1, verified=True)  # promised: (2 + 3) / (1 + 1) = 2.5
    assert routing.by_length == {4: MatchRecord(verifies=1.5, accepted=2.0)}
    assert routing.request_record("r") == RequestRecord(steps=1.25, accepted=1.5,
                                                        promised=3.25)
    routing.observe("r", 3, verified=True)  # lookup did not draft for it this step
    assert routing.by_length == {4: MatchRecord(verifies=1.5, accepted=2.0)}


def test_an_outcome_that_verified_nothing_counts_nothing():
    routing = LookupRouting(EXACT)
    routing.drafting([LookupMatch("r", 2, 2.0)])
    routing.observe("r", 0, verified=False)  # e.g. preempted: no token, no draft verified
    assert routing.by_length == {} and routing.tracked == frozenset()


def test_a_request_whose_lookup_steps_miss_leaves_a_record_learned_elsewhere():
    """The record by length says 4-token matches made 3 accepted drafts in 9 steps. A request's
    own lookup steps scale it: after two misses its matches go to the model (promising 2.5
    tokens), while another request, and the record alone, still send them to lookup."""
    routing = LookupRouting(EXACT, {4: MatchRecord(verifies=9.0, accepted=27.0)})
    a, b = LookupMatch("a", 4, 2.5), LookupMatch("b", 4, 2.5)
    made = []
    for _ in range(3):
        made.append(routing.expected_tokens(4, "a"))
        if routing.prefers_lookup(a, None):
            routing.drafting([a])
            routing.observe("a", 0, verified=True)
    # 1 + 30/10; then the record (10, 27) scaled by (0 + 6) / (3 + 6); then (11, 27)
    # scaled by (0 + 63/11) / (63/11 + 63/11)
    assert made == pytest.approx([4.0, 1 + 20 / 11, 2.25])
    assert routing.request_record("a") == pytest.approx(RequestRecord(2.0, 0.0, 3 + 30 / 11))
    assert not routing.prefers_lookup(a, None) and routing.prefers_lookup(b, None)
    assert routing.expected_tokens(4) == 3.5  # 1 + 30/12: alone, the record still says lookup
    assert routing.preferred(chain_step(a, b)) == {"b"}


def test_with_adaptive_speculation_costs_weigh_tokens_per_second():
    routing = LookupRouting(EXACT)
    match = LookupMatch("r", 2, 3.0)  # lookup: 4 tokens per step (untried), the model 3
    dear_lookup = StepCosts(lookup=1.0, model=0.5)  # 4 per second against 6
    assert not routing.prefers_lookup(match, dear_lookup)
    assert routing.preferred(chain_step(match, costs=dear_lookup)) == frozenset()
    # k fixed: costs are not weighed, the more often right source drafts
    assert routing.preferred(chain_step(match, costs=dear_lookup, adaptive=False)) == {"r"}
    assert routing.preferred(chain_step(match)) == {"r"}  # costs not measured yet: tokens


def test_with_k_fixed_a_match_joins_the_head_tree():
    """In a tree step with k fixed the model's tree, the match joined, is the more often right
    source: no match is preferred however lookup has paid, and every one is passed over
    where the model drafts. In chain steps the record still routes."""
    routing = LookupRouting(EXACT, {3: MatchRecord(verifies=10.0, accepted=30.0)})
    matches = (LookupMatch("a", 3, 1.5), LookupMatch("b", 1, 1.5))
    tree = RoutingStep(matches, tree=True, adaptive=False)
    assert routing.prefers_lookup(matches[0], None) and routing.prefers_lookup(matches[1], None)
    assert routing.preferred(tree) == frozenset()
    assert routing.route(tree, frozenset(), model_drafts=True) == Routing((), matches)
    chain = RoutingStep(matches, tree=False, adaptive=False)
    assert routing.preferred(chain) == {"a", "b"}
    assert routing.route(chain, frozenset({"a", "b"}), model_drafts=True) == Routing(matches, ())


def test_in_a_model_step_a_match_stays_with_lookup_only_where_it_makes_as_many_tokens():
    """Lookup-only steps cost a tenth of the model's here, so both matches are preferred; where
    the model drafts anyway, only the one whose length makes the model's 3.5 tokens stays. Where
    the model does not draft, every match drafts with lookup, the ones not preferred too."""
    routing = LookupRouting(EXACT, {1: MatchRecord(verifies=3.0, accepted=1.0)})
    long, short = LookupMatch("long", 4, 3.5), LookupMatch("short", 1, 3.5)  # 4.0 and 2.0
    other = LookupMatch("other", 1, 25.0)
    step = chain_step(long, short, other, costs=StepCosts(lookup=0.1, model=1.0))
    preferred = routing.preferred(step)
    assert preferred == {"long", "short"}  # 2.0 / 0.1 >= 3.5 / 1, not >= 25 / 1
    assert routing.route(step, preferred, model_drafts=True) == Routing((long,), (short, other))
    assert routing.route(step, preferred, model_drafts=False) == Routing((long, short, other), ())


def test_a_passed_over_length_fades_toward_its_prior_once_per_match():
    routing = LookupRouting(RoutingParams(k=3, tree_size=12, decay=0.5),
                            {2: MatchRecord(verifies=8.0, accepted=4.0)})
    passed = (LookupMatch("a", 2, 3.0), LookupMatch("b", 2, 3.0), LookupMatch("c", 5, 3.0))
    routing.fade_passed_over(Routing((), passed))
    assert routing.by_length == {2: MatchRecord(verifies=2.0, accepted=1.0)}  # untried stays so
    assert routing.expected_tokens(2) == 1 + 4 / 3


def test_forgetting_finished_and_aborted_requests_drops_their_state_only():
    routing = LookupRouting(EXACT)
    routing.drafting([LookupMatch("done", 2, 2.0), LookupMatch("aborted", 3, 2.0),
                      LookupMatch("running", 3, 2.0)])
    routing.observe("done", 1, verified=True)
    routing.drafting([LookupMatch("done", 2, 2.0)])  # drafted again, then finished
    routing.forget(["done", "aborted", "never-seen"])
    assert routing.tracked == {"running"}
    assert routing.request_record("done") is None
    assert routing.by_length == {2: MatchRecord(verifies=1.0, accepted=1.0)}  # traffic's stays
    routing.observe("done", 2, verified=True)  # a late outcome of a forgotten request: nothing
    assert routing.by_length == {2: MatchRecord(verifies=1.0, accepted=1.0)}


def test_join_puts_lookups_first_continuation_whole_before_the_models_tree():
    lookup = Draft([1, 2, 3, 7, 8], None, [-1, 0, 1, -1, 3])  # two continuations: 1 2 3, 7 8
    model = Draft([4, 5, 6], None, [-1, 0, -1])
    assert LookupRouting(EXACT).join(lookup, model, 3) == Draft(
        [1, 2, 3, 4, 5, 6, 7, 8], None, [-1, 0, 1, -1, 3, -1, -1, 6])
    by_probability = RoutingParams(k=3, tree_size=12, lookup_branches=False)
    assert LookupRouting(by_probability).join(lookup, model, 3) == Draft(
        [1, 2, 3, 4, 5, 6], None, [-1, 0, 1, -1, 3, -1])
    full = RoutingParams(k=3, tree_size=4)  # the model keeps what room is left
    assert LookupRouting(full).join(lookup, model, 3) == Draft([1, 2, 3, 4], None,
                                                               [-1, 0, 1, -1])
    assert LookupRouting(EXACT).join(lookup, model, 2) == Draft(
        [1, 2, 4, 5, 6, 7, 8], None, [-1, 0, -1, 2, -1, -1, 5])  # lookup cut to the depth
    assert LookupRouting(EXACT).join(None, model, 3) is model
    assert LookupRouting(EXACT).join(Draft([]), model, 3) is model
