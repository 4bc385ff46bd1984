"""The verify shortlist: greedy verification scoring the whole vocabulary only on the rows the
walk visits gives exactly what scoring every row gives."""

from __future__ import annotations

import random

import torch

from kiln.runner.sampler import Sampler, SamplingRow
from kiln.runner.verify import VerifyGroup, verify
from kiln.sampling_params import SamplingParams
from kiln.speculative.shortlist import (
    SHORTLIST_MIN_ROWS,
    Shortlist,
    shortlist_applies,
    verify_shortlisted,
)

V, H = 40, 8


def random_step(rng: random.Random, weight: torch.Tensor):
    """Hidden rows and groups (plain rows, chains, trees) whose drafts often are the target's
    choice at their parent's row, so walks go deep; some requests penalize repeats."""
    groups, rows = [], []
    hidden = torch.randn(64, H, generator=torch.Generator().manual_seed(rng.randrange(10**6)))
    choice = (hidden @ weight.T).argmax(dim=-1).tolist()
    for _ in range(rng.randint(1, 4)):
        first, kind = len(rows), rng.choice(["plain", "chain", "tree"])
        n = {"plain": 0, "chain": rng.randint(1, 4), "tree": rng.randint(2, 9)}[kind]
        parents = [rng.randrange(-1, i) for i in range(n)] if kind == "tree" else None
        drafts = []
        for i in range(n):
            parent_row = i if parents is None else 1 + parents[i] if parents[i] >= 0 else 0
            hit = rng.random() < 0.7
            drafts.append(choice[first + parent_row] if hit else rng.randrange(V))
        params = SamplingParams(temperature=0, repetition_penalty=rng.choice([1.0, 1.0, 1.5]))
        history = [rng.randrange(V) for _ in range(rng.randint(0, 6))]
        rows += [SamplingRow(params, [1, 2], history, None) for _ in range(n + 1)]
        groups.append(VerifyGroup(first, drafts, None, parents))
    return hidden[:len(rows)], rows, groups


def test_shortlisted_verification_is_the_full_verification():
    """Random steps and shortlists, from none of the target's choices to all of them: tokens
    and paths equal verify()'s on every row's full logits; with the whole vocabulary
    shortlisted and nothing penalized, exactly the rows the walk visits are scored."""
    rng = random.Random(0)
    weight = torch.randn(V, H, generator=torch.Generator().manual_seed(1))
    sampler = Sampler(V, frozenset())
    rounds = []
    for case in range(300):
        hidden, rows, groups = random_step(rng, weight)
        everything = case % 3 == 0
        ids = torch.arange(V) if everything else torch.tensor(
            sorted(rng.sample(range(V), rng.randint(1, V - 1))))
        shortlist = Shortlist(ids, lambda h, ids=ids: h @ weight[ids].T)
        scored = []

        def logits_of(h, scored=scored):
            scored.append(len(h))
            return h @ weight.T

        expected = verify(sampler, hidden @ weight.T, rows, groups)
        tokens, paths = verify_shortlisted(shortlist, hidden, rows, groups, sampler, logits_of)
        assert (tokens, paths) == (expected.token_ids, expected.paths), case
        assert sum(scored) <= len(rows)
        rounds.append(len(scored))
        if everything and all(r.params.repetition_penalty == 1.0 for r in rows):
            assert scored == [sum(len(t) for t in tokens)]
    assert min(rounds) == 1 and max(rounds) >= 3  # misses send the walk to unscored rows


def test_the_shortlist_applies_to_greedy_steps_with_enough_rows_only():
    greedy = SamplingParams(temperature=0)
    n = SHORTLIST_MIN_ROWS

    def step(params, drafts=n - 1, rows=n):
        return [SamplingRow(params, [1], [], None)] * rows, [VerifyGroup(0, [3] * drafts)]

    assert shortlist_applies(*step(greedy), False)
    assert not shortlist_applies(*step(greedy, rows=n - 1, drafts=n - 2), False)
    assert not shortlist_applies(*step(greedy), True)  # prompt logprobs or a grammar
    assert not shortlist_applies(*step(SamplingParams(temperature=0.7)), False)
    assert not shortlist_applies(*step(SamplingParams(temperature=0, logprobs=1)), False)
    rows, _ = step(greedy)
    assert not shortlist_applies(rows, [VerifyGroup(i, []) for i in range(n)], False)
