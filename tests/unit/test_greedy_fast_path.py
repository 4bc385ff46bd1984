"""The runner's argmax-only path (`plain_greedy`, `greedy_tokens`): which steps take it, and
that it gives what the full sampling path gives."""

from __future__ import annotations

import torch

from kiln.engine.contract import ScheduledRequest
from kiln.runner.batch import LogitsRows
from kiln.runner.hooks import NoGrammar
from kiln.runner.sampler import Sampler
from kiln.runner.step_sampling import StepSampling, greedy_tokens, plain_greedy
from kiln.sampling_params import SamplingParams


def item(rid: str = "a", **changes) -> ScheduledRequest:
    params = changes.pop("params", SamplingParams(temperature=0, max_tokens=8))
    fields = dict(request_id=rid, token_ids=[5], start_pos=3, num_draft_tokens=0, block_ids=[0],
                  samples=True, params=params, prompt_token_ids=[1, 2, 3],
                  output_token_ids=[4], prompt_logprobs=False)
    return ScheduledRequest(**(fields | changes))


def test_only_raw_argmax_steps_take_the_fast_path():
    assert plain_greedy([item(), item("b")])
    sampled = SamplingParams(temperature=0.7, max_tokens=8)
    for other in (item(params=sampled), item(grammar=object()), item(prompt_logprobs=True),
                  item(token_ids=[5, 9], num_draft_tokens=1),
                  item(params=SamplingParams(temperature=0, logprobs=2)),
                  item(params=SamplingParams(temperature=0, repetition_penalty=1.2)),
                  item(params=SamplingParams(temperature=0, presence_penalty=0.5)),
                  item(params=SamplingParams(temperature=0, min_tokens=2))):  # 1 output so far
        assert not plain_greedy([item(), other])
    assert plain_greedy([item(params=SamplingParams(temperature=0, min_tokens=1))])  # met


def test_fast_path_tokens_equal_the_sampling_path():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 70, generator=gen)
    logits[1, 3] = logits[1, 60] = logits[1].max() + 1  # a tie: the first wins
    logits[0, 65] = 100.0  # past the vocabulary (a padded head): never chosen
    scheduled = [item("a"), item("b", samples=False), item("c")]
    rows = [LogitsRows(0, 1, 0, 0), LogitsRows(1, 0, 1, 0), LogitsRows(1, 1, 1, 0)]
    fast = greedy_tokens(rows, logits, 64)
    sampling = StepSampling(Sampler(64, frozenset({0})), torch.device("cpu"))
    plan = sampling.plan(scheduled, rows, NoGrammar(64))
    full, _, _ = sampling.sample(scheduled, plan, logits)
    assert fast == full == [[int(logits[0, :64].argmax())], [], [3]]
