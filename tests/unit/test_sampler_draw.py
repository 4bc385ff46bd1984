"""The sampler's random draw: one uniform per row through the row's cumulative distribution."""

import torch

from kiln.runner.sampler import Sampler, SamplingRow, inverse_cdf_draw
from kiln.sampling_params import SamplingParams

# chi-square critical values at p = 0.001, by degrees of freedom
CHI2_999 = {3: 16.27, 4: 18.47, 5: 20.52}


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    keep = probs > 0
    expected = probs[keep] * counts.sum()
    return float(((counts[keep] - expected) ** 2 / expected).sum()), int(keep.sum()) - 1


def test_draws_follow_the_distribution_and_never_pick_zero_probability():
    p = torch.tensor([0.0, 0.40, 0.25, 0.0, 0.15, 0.10, 0.10, 0.0])
    n = 20000
    u = torch.rand(n, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    drawn = inverse_cdf_draw(p.expand(n, -1), u)
    counts = torch.bincount(drawn, minlength=len(p)).double()
    assert counts[p == 0].sum() == 0
    stat, dof = chi_square(counts, p.double())
    assert stat < CHI2_999[dof], counts


def test_edges_of_the_uniform_stay_on_tokens_with_mass():
    p = torch.tensor([[0.0, 0.5, 0.5, 0.0], [0.0, 0.0, 1.0, 0.0], [2.0, 0.0, 0.0, 2.0]])
    # u = 0 takes the first token with mass; u just under 1 the last one; rows need not sum to 1
    assert inverse_cdf_draw(p, torch.zeros(3, dtype=torch.float64)).tolist() == [1, 2, 0]
    almost_one = torch.full((3,), 1 - 2 ** -40, dtype=torch.float64)
    assert inverse_cdf_draw(p, almost_one).tolist() == [2, 2, 3]


def row(params: SamplingParams, seed: int | None = None) -> SamplingRow:
    gen = None if seed is None else torch.Generator().manual_seed(seed)
    return SamplingRow(params, [1], [], gen)


def test_a_seeded_row_draws_the_same_whatever_shares_its_batch():
    vocab = 64
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(1))
    seeded = SamplingParams(temperature=1.0, seed=5)
    other = SamplingParams(temperature=0.8)
    alone = Sampler(vocab, frozenset())(logits[:1], [row(seeded, 5)]).token_ids
    batch = Sampler(vocab, frozenset(), seed=3)(
        logits[[1, 0, 2]], [row(other), row(seeded, 5), row(other)]).token_ids
    assert batch[1] == alone[0]


def test_top_k_and_greedy_rows_in_one_batch():
    vocab = 32
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(2))
    top2 = set(logits[0].topk(2).indices.tolist())
    sampler = Sampler(vocab, frozenset())
    rows = [row(SamplingParams(temperature=1.5, top_k=2)), row(SamplingParams(temperature=0.0))]
    for _ in range(200):
        first, second = sampler(logits, rows).token_ids
        assert first in top2
        assert second == int(logits[1].argmax())
