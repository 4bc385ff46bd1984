"""Verification of draft tokens: greedy longest-prefix acceptance and rejection sampling."""

from __future__ import annotations

import pytest
import torch

from kiln.runner.sampler import Sampler, SamplingRow
from kiln.runner.verify import (
    VerifyGroup,
    accept_greedy,
    accept_greedy_tree,
    accept_sampled,
    accept_sampled_tree,
    verify,
)
from kiln.sampling_params import SamplingParams

V = 6


def rows_for(params: SamplingParams, n: int, seed: int | None = None) -> list[SamplingRow]:
    gen = None if seed is None else torch.Generator().manual_seed(seed)
    return [SamplingRow(params, [1, 2], [], gen) for _ in range(n)]


def test_greedy_accepts_longest_matching_prefix_plus_bonus():
    assert accept_greedy([5, 6, 7], [5, 6, 9, 1]) == [5, 6, 9]
    assert accept_greedy([5, 6, 7], [5, 6, 7, 1]) == [5, 6, 7, 1]
    assert accept_greedy([5, 6, 7], [4, 6, 7, 1]) == [4]
    assert accept_greedy([], [3]) == [3]


def test_verify_mixes_plain_greedy_and_drafted_rows():
    sampler = Sampler(V, frozenset())
    greedy = SamplingParams(temperature=0)
    # request a: no drafts (1 row); request b: drafts [2, 3] (3 rows)
    logits = torch.full((4, V), -5.0)
    logits[0, 4] = 5  # a -> 4
    logits[1, 2] = 5  # b row 0 -> 2 (draft 2 accepted)
    logits[2, 1] = 5  # b row 1 -> 1 (draft 3 rejected, 1 emitted)
    logits[3, 0] = 5
    out = verify(sampler, logits, rows_for(greedy, 4),
                 [VerifyGroup(0, []), VerifyGroup(1, [2, 3])])
    assert out.token_ids == [[4], [2, 1]]
    assert out.logprobs is None


def test_logprobs_come_from_the_row_that_chose_each_token():
    sampler = Sampler(V, frozenset())
    params = SamplingParams(temperature=0, logprobs=2)
    logits = torch.randn(3, V)
    drafts = [int(logits[0].argmax()), int(logits[1].argmax())]
    out = verify(sampler, logits, rows_for(params, 3), [VerifyGroup(0, drafts)])
    assert out.token_ids[0] == drafts + [int(logits[2].argmax())]
    expected = torch.log_softmax(logits, -1)
    for j, lp in enumerate(out.logprobs[0]):
        assert lp.token_id == out.token_ids[0][j]
        assert lp.logprob == pytest.approx(float(expected[j, lp.token_id]), abs=1e-5)
        assert len(lp.top_ids) == 2


def chi_square(counts: torch.Tensor, expected_probs: torch.Tensor) -> tuple[float, int]:
    n = counts.sum()
    keep = expected_probs * n >= 5
    expected = expected_probs[keep] * n
    stat = float(((counts[keep] - expected) ** 2 / expected).sum())
    return stat, int(keep.sum()) - 1


# critical values of chi-square at p = 0.001 (a false alarm in 1 run of 1000)
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12,
            9: 27.88, 10: 29.59, 11: 31.26, 12: 32.91, 13: 34.53, 14: 36.12, 15: 37.70}


@pytest.mark.parametrize("with_q", [False, True], ids=["one-hot-drafts", "sampled-drafts"])
def test_rejection_sampling_keeps_the_target_distribution(with_q):
    """First and second emitted tokens follow p exactly, whatever the proposer's q."""
    gen = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.40, 0.25, 0.15, 0.10, 0.06, 0.04],
                      [0.05, 0.50, 0.05, 0.20, 0.10, 0.10],
                      [0.30, 0.10, 0.10, 0.10, 0.20, 0.20]])
    q = torch.tensor([[0.10, 0.10, 0.50, 0.10, 0.10, 0.10],
                      [0.30, 0.30, 0.10, 0.10, 0.10, 0.10]])
    n = 10000
    drafts = (torch.stack([torch.multinomial(q[j], n, replacement=True, generator=gen)
                           for j in range(2)], dim=1) if with_q
              else torch.tensor([[2, 1]]).expand(n, 2)).tolist()  # fixed guesses: one-hot q
    uniforms = torch.rand(n, 2, generator=gen)
    final_u = torch.rand(n, dtype=torch.float64, generator=gen)
    first = torch.zeros(V)
    second = torch.zeros(V)  # given the first draft was accepted
    for i in range(n):
        out = accept_sampled(drafts[i], p, q if with_q else None, uniforms[i], final_u[i])
        first[out[0]] += 1
        if len(out) > 1:
            second[out[1]] += 1
    for counts, probs in ((first, p[0]), (second, p[1])):
        stat, dof = chi_square(counts, probs)
        assert stat < CHI2_999[dof], (counts, probs)


def test_seeded_requests_verify_reproducibly():
    sampler = Sampler(V, frozenset())
    params = SamplingParams(temperature=1.0, seed=7)
    logits = torch.randn(3, V)
    outs = [verify(sampler, logits, rows_for(params, 3, seed=7), [VerifyGroup(0, [1, 2])])
            .token_ids for _ in range(3)]
    assert outs[0] == outs[1] == outs[2]


def test_a_draft_outside_top_k_is_always_rejected():
    sampler = Sampler(V, frozenset())
    params = SamplingParams(temperature=1.0, top_k=2)
    logits = torch.tensor([[4.0, 3.0, 0.0, 0.0, 0.0, 0.0]] * 2)
    for seed in range(20):
        out = verify(sampler, logits, rows_for(params, 2, seed=seed), [VerifyGroup(0, [5])])
        assert out.token_ids[0][0] in (0, 1) and len(out.token_ids[0]) == 1


# a tree of 5 drafts: root -> 2 (node 0) -> 1 (node 1); root -> 1 (node 2) -> 3 (node 3),
# 4 (node 4)
TREE_TOKENS, TREE_PARENTS = [2, 1, 1, 3, 4], [-1, 0, -1, 2, 2]


@pytest.mark.parametrize(("target", "emitted", "path"), [
    ([2, 1, 0, 0, 0, 0], [2, 1, 0], [0, 1]),  # the first branch to its end, then the bonus
    ([1, 0, 0, 4, 0, 0], [1, 4, 0], [2, 4]),  # the second branch, then node 2's second child
    ([1, 0, 0, 5, 0, 5], [1, 5], [2]),  # node 2's row picks a token no child has
    ([1, 0, 0, 3, 0, 0], [1, 3, 0], [2, 3]),  # node 2's row 3 = child node 3 (a leaf)
    ([5, 2, 1, 1, 1, 1], [5], []),  # no child of the root
])
def test_greedy_tree_walk(target, emitted, path):
    # rows: 0 = root, 1 + i = draft i
    assert accept_greedy_tree(TREE_TOKENS, TREE_PARENTS, target) == (emitted, path)


def test_verify_reports_tree_paths_and_logprobs_from_the_path_rows():
    sampler = Sampler(V, frozenset())
    logits = torch.full((6, V), -5.0)
    for row, token in enumerate([1, 0, 0, 3, 0, 0]):  # root -> node 2 -> node 3 -> bonus
        logits[row, token] = 5.0
    logits[4, 2] = 4.0  # node 3's row: second choice 2
    rows = rows_for(SamplingParams(temperature=0, logprobs=1), 6)
    out = verify(sampler, logits, rows, [VerifyGroup(0, TREE_TOKENS, None, TREE_PARENTS)])
    assert out.token_ids == [[1, 3, 0]] and out.paths == [[2, 3]]
    assert [lp.top_ids[0] for lp in out.logprobs[0]] == [1, 3, 0]  # rows 0, 3, 4


def test_tree_rejection_sampling_keeps_the_target_distribution():
    """Sampling by elimination down a tree: the first token follows p[root] whichever of the
    root's children (or none) it lands on, and the second follows the chosen child's row."""
    gen = torch.Generator().manual_seed(1)
    p = torch.tensor([[0.40, 0.25, 0.15, 0.10, 0.06, 0.04],  # root
                      [0.05, 0.50, 0.05, 0.20, 0.10, 0.10],  # after node 0 (token 2)
                      [0.30, 0.10, 0.10, 0.10, 0.20, 0.20],  # after node 1
                      [0.10, 0.10, 0.20, 0.20, 0.20, 0.20],  # after node 2 (token 1)
                      [1 / 6] * 6, [1 / 6] * 6])
    n = 20000
    uniforms = torch.rand(n, 5, generator=gen)
    final_u = torch.rand(n, dtype=torch.float64, generator=gen)
    first = torch.zeros(V)
    second = {2: torch.zeros(V), 1: torch.zeros(V)}
    for i in range(n):
        out, path = accept_sampled_tree(TREE_TOKENS, TREE_PARENTS, p, uniforms[i], final_u[i])
        assert [TREE_TOKENS[c] for c in path] == out[:len(path)]
        first[out[0]] += 1
        if len(out) > 1:
            second[out[0]][out[1]] += 1
    for counts, probs in ((first, p[0]), (second[2], p[1]), (second[1], p[3])):
        stat, dof = chi_square(counts, probs)
        assert stat < CHI2_999[dof], (counts, probs)
