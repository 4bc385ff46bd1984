"""sampling.cpp: argmax_rows against torch.argmax, top_logprobs against log_softmax then topk."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.common import needs_cpu_kernels

pytestmark = needs_cpu_kernels


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_top_logprobs_is_log_softmax_then_topk(dtype):
    """A speculator's likeliest drafts in one call: the k largest logits per row as
    log-probabilities over the whole row, best first, mapped through `ids`; among equal
    logits (common in bf16) the lower index comes first."""
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(5, 300, generator=gen) * 3).to(dtype)
    logits[2, 7] = logits[2, 3] = logits[2].max() + 1  # a tie at the top
    ids = torch.randperm(1000, generator=gen)[:300]
    values, index = torch.ops.kiln.top_logprobs(logits, 6, ids)
    logp = logits.float().log_softmax(dim=-1)
    for r in range(5):
        order = sorted(range(300), key=lambda i: (-logp[r, i].item(), i))[:6]
        assert index[r].tolist() == ids[order].tolist()
        torch.testing.assert_close(values[r], logp[r, order], rtol=0, atol=2e-6)
    assert index[2, :2].tolist() == [ids[3].item(), ids[7].item()]
    with pytest.raises(RuntimeError, match="k must be"):
        torch.ops.kiln.top_logprobs(logits, 301, ids)


@pytest.mark.parametrize("vocab", [1, 15, 16, 17, 300, 49152])
def test_argmax_rows_is_torch_argmax(vocab):
    """Every row's argmax as torch gives it, at every width around the vector's 16 lanes:
    equal maxima (in one lane, across lanes, in the scalar tail) resolve to the first, and a
    NaN ranks above everything (its first one wins)."""
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(9, vocab, generator=gen) * 4
    logits[1] = logits[1].round()  # many ties
    if vocab > 3:
        logits[2, [vocab - 1, 1, vocab // 2]] = 100.0  # one max three times
        logits[3, [vocab - 2, vocab - 1]] = float("nan")
        logits[4, 0] = logits[4, vocab - 1] = float("nan")
    logits[5] = float("-inf")
    logits[6] = 0.0
    logits[6, -1] = -0.0
    logits[7, -1] = 50.0  # the last column (the tail past the last full vector)
    got = torch.ops.kiln.argmax_rows(logits)
    assert got.dtype == torch.int64
    assert got.tolist() == logits.argmax(dim=-1).tolist()
    assert torch.ops.kiln.argmax_rows(logits[:, :vocab // 2 + 1]).tolist() == \
        logits[:, :vocab // 2 + 1].argmax(dim=-1).tolist()  # a strided view
    with pytest.raises(RuntimeError, match="fp32 logits"):
        torch.ops.kiln.argmax_rows(logits.bfloat16())
