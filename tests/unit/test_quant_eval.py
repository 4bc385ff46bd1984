"""KL divergence math on hand-built distributions, fidelity statistics, evaluation text."""

import math

import pytest
import torch

from kiln.quant.calibration import (
    CALIB_MODULES,
    HELDOUT_MODULES,
    Split,
    TextSpec,
    builtin_texts,
    spread_windows,
)
from kiln.quant.evaluate import PositionStats, RefRows, kl_divergence


def logp(*rows: list[float]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64).log().float()


def test_kl_of_a_distribution_with_itself_is_zero():
    p = torch.log_softmax(torch.randn(5, 11), -1)
    assert torch.equal(kl_divergence(p, p), torch.zeros(5))


def test_kl_matches_the_formula_on_two_outcomes():
    kl = kl_divergence(logp([0.5, 0.5]), logp([0.9, 0.1]))
    expected = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)
    assert kl.item() == pytest.approx(expected, rel=1e-6)


def test_kl_is_asymmetric():
    p, q = logp([0.5, 0.5]), logp([0.9, 0.1])
    assert kl_divergence(p, q).item() != pytest.approx(kl_divergence(q, p).item(), rel=1e-3)


def test_outcomes_the_reference_rules_out_cost_nothing():
    """0 * log(0 / q) = 0, even where the other model gives them no mass either (log 0 = -inf)."""
    assert kl_divergence(logp([1.0, 0.0]), logp([0.5, 0.5])).item() == pytest.approx(math.log(2))
    assert kl_divergence(logp([1.0, 0.0]), logp([1.0, 0.0])).item() == 0.0


def test_cached_reference_rows_give_the_same_kl():
    ref = torch.log_softmax(torch.randn(7, 50) * 3, -1)
    other = torch.log_softmax(torch.randn(7, 50) * 3, -1)
    rows = RefRows.of(ref)
    torch.testing.assert_close(rows.kl(other), kl_divergence(ref, other), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(rows[2:5].kl(other[2:5]), kl_divergence(ref, other)[2:5],
                               rtol=1e-5, atol=1e-6)


def test_summary_statistics_on_hand_built_positions():
    """Two positions: identical (KL 0, same argmax), then 0.5/0.5 vs 0.1/0.9 (argmax 0 vs 1)."""
    ref = logp([0.2, 0.8], [0.5, 0.5])
    other = logp([0.2, 0.8], [0.1, 0.9])
    stats = PositionStats.empty()
    stats.add(RefRows.of(ref), other, torch.tensor([1, 0]))
    ref_nll = -torch.tensor([math.log(0.8), math.log(0.5)])
    fid = stats.summary(ref_nll)
    second = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)
    assert fid.mean_kl == pytest.approx(second / 2, rel=1e-5)
    assert fid.p99_kl == pytest.approx(0.99 * second, rel=1e-5)  # linear between 0 and max
    assert fid.top1_agreement == 0.5
    assert fid.ppl == pytest.approx(math.exp(-(math.log(0.8) + math.log(0.1)) / 2), rel=1e-5)
    assert fid.ref_ppl == pytest.approx(math.exp(-(math.log(0.8) + math.log(0.5)) / 2))
    assert fid.tokens == 2


def test_windows_are_spread_without_overlap_and_deterministic():
    ids = list(range(1000))
    w = spread_windows(ids, 4, 100)
    assert w.shape == (4, 100)
    starts = w[:, 0].tolist()
    assert starts == [0, 300, 600, 900] and torch.equal(w, spread_windows(ids, 4, 100))
    assert all(torch.equal(row, torch.arange(s, s + 100)) for row, s in zip(w, starts, strict=True))
    with pytest.raises(ValueError, match="need 1100"):
        spread_windows(ids, 11, 100)


def test_builtin_calibration_and_held_out_text_are_disjoint():
    assert not set(CALIB_MODULES) & set(HELDOUT_MODULES)
    calib_code, calib_prose = builtin_texts(Split.CALIBRATION)
    held_code, held_prose = builtin_texts(Split.HELDOUT)
    assert len(calib_code) > 50_000 and len(held_prose) > 100_000
    assert calib_prose[:2000] not in held_prose and held_code[:2000] not in calib_code


def test_text_spec_validates():
    with pytest.raises(ValueError):
        TextSpec(windows=0)
