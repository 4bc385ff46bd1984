"""sampling.cpp: top_logprobs against log_softmax then topk."""

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
