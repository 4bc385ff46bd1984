"""The sampler's greedy fast path for grammar masks (kiln.runner.sampler): rows whose raw argmax
the grammar allows skip the mask, and the tokens are exactly those of masking every row."""

from __future__ import annotations

import pytest
import torch

from kiln.runner import grammar_argmax
from kiln.runner.sampler import Sampler, SamplingRow, apply_token_bitmask
from kiln.sampling_params import SamplingParams

VOCAB = 1000


def _case(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(8, VOCAB, generator=gen)
    logits[3, 10] = logits[3, 20] = 9.0  # a tie: the lower id wins, masked or not
    bitmask = torch.randint(-2**31, 2**31 - 1, (8, 32), generator=gen,
                            dtype=torch.int64).to(torch.int32)
    for row in (0, 2, 3):  # these rows' argmax is allowed: no mask needed
        top = int(logits[row].argmax())
        bitmask[row, top // 32] |= torch.tensor(1 << (top % 32)).to(torch.int32)
    bitmask[3, 0] &= ~torch.tensor(1 << 10).to(torch.int32) if seed % 2 else -1
    return logits, bitmask


def _rows(greedy: bool) -> list[SamplingRow]:
    params = SamplingParams(temperature=0.0 if greedy else 0.7, seed=None if greedy else 1)
    return [SamplingRow(params, [], [], None, b) for b in (0, 1, 2, 3, None, 5, 6, 7)]


def _masked_everywhere(logits: torch.Tensor, rows, bitmask) -> list[int]:
    full = logits.clone()
    apply_token_bitmask(full, rows, bitmask)
    return full.argmax(dim=-1).tolist()


def test_the_greedy_fast_path_picks_the_masked_argmax():
    for seed in range(6):
        logits, bitmask = _case(seed)
        rows = _rows(greedy=True)
        expected = _masked_everywhere(logits, rows, bitmask)
        out = Sampler(VOCAB, frozenset())(logits, rows, bitmask)
        assert out.token_ids == expected, seed


def test_the_logits_stand_when_every_argmax_is_allowed():
    logits, bitmask = _case(0)
    bitmask[:] = -1  # everything allowed
    sampler = Sampler(VOCAB, frozenset())
    processed = sampler.process(logits, _rows(greedy=True), bitmask)
    assert processed is logits  # no copy, no mask
    assert sampler.choose(processed, _rows(greedy=True)).tolist() == \
        logits.argmax(dim=-1).tolist()


def test_sampled_rows_are_still_masked_in_full():
    logits, bitmask = _case(1)
    rows = _rows(greedy=False)
    processed = Sampler(VOCAB, frozenset()).process(logits, rows, bitmask)
    reference = logits.clone()
    apply_token_bitmask(reference, rows, bitmask)
    assert torch.equal(processed, reference)


def test_a_dense_row_whose_top_candidates_are_all_forbidden_is_masked_in_full(monkeypatch):
    monkeypatch.setattr(grammar_argmax, "SPARSE_WORDS", 4)  # 32 words here: a dense row
    logits, bitmask = _case(2)
    bitmask[1] = -1
    for token in logits[1].topk(16).indices.tolist():  # all but the top 16 allowed
        bitmask[1, token // 32] &= ~torch.tensor(1 << (token % 32)).to(torch.int32)
    rows = _rows(greedy=True)
    expected = _masked_everywhere(logits, rows, bitmask)
    sampler = Sampler(VOCAB, frozenset())
    processed = sampler.process(logits, rows, bitmask)
    assert int(torch.isinf(processed[1]).sum()) == 16  # the full mask, not a +inf pick
    assert sampler.choose(processed, rows).tolist() == expected


def test_every_path_of_the_fast_path_matches_the_full_mask(monkeypatch):
    """Rows of every kind: argmax allowed; a few allowed ids (a forced key: enumerated);
    dense masks (top candidates); nothing allowed; allowed ids all -inf; ties."""
    monkeypatch.setattr(grammar_argmax, "SPARSE_WORDS", 8)  # the random rows are dense
    gen = torch.Generator().manual_seed(7)
    for trial in range(20):
        logits = torch.randn(12, VOCAB, generator=gen).round(decimals=1)  # many ties
        bitmask = torch.randint(-2**31, 2**31 - 1, (12, 32), generator=gen,
                                dtype=torch.int64).to(torch.int32)
        for row in (1, 2, 3):  # sparse: a handful of allowed ids
            bitmask[row] = 0
            for token in torch.randint(0, VOCAB, (row * 2,), generator=gen).tolist():
                bitmask[row, token // 32] |= torch.tensor(1 << (token % 32)).to(torch.int32)
        bitmask[4] = 0  # nothing allowed
        logits[5] = float("-inf")  # every allowed logit -inf
        rows = [SamplingRow(SamplingParams(temperature=0.0), [], [], None, i) for i in range(12)]
        expected = _masked_everywhere(logits, rows, bitmask)
        out = Sampler(VOCAB, frozenset())(logits, rows, bitmask)
        assert out.token_ids == expected, trial


def test_logprobs_come_from_the_raw_logits():
    """Without logprobs the fast path changes the forbidden rows in place (no copy); with
    them the raw logits stay as they were and the logprobs are the model's."""
    logits, bitmask = _case(3)
    raw = logits.clone()
    params = SamplingParams(temperature=0.0, logprobs=2)
    rows = [SamplingRow(params, [], [], None, b) for b in (0, 1, 2, 3, None, 5, 6, 7)]
    out = Sampler(VOCAB, frozenset())(logits, rows, bitmask)
    assert torch.equal(logits, raw)
    expected = torch.log_softmax(raw, dim=-1)[torch.arange(8), torch.tensor(out.token_ids)]
    assert [lp.logprob for lp in out.logprobs] == pytest.approx(expected.tolist())
    Sampler(VOCAB, frozenset())(logits, _rows(greedy=True), bitmask)
    assert not torch.equal(logits, raw)  # changed in place: nobody reads the raw rows
