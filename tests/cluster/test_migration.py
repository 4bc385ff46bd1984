"""What the gateway does with a request whose worker is lost, and how legs hand over."""

from __future__ import annotations

from kiln.cluster.engine_client import OutputStream
from kiln.cluster.migration import (
    Leg,
    Recovery,
    Tracked,
    plan_recovery,
    prefill_request,
    without_finish,
)
from kiln.engine.contract import EngineCoreOutput
from kiln.engine.core import EngineRequest
from kiln.sampling_params import SamplingParams


def tracked(max_tokens: int | None = 8, **params) -> Tracked:
    request = EngineRequest(request_id="r", prompt_token_ids=[1, 2, 3],
                            params=SamplingParams(max_tokens=max_tokens, **params),
                            cache_salt="s")
    return Tracked(request, OutputStream(["r"], lambda ids: None), "w1", Leg.LOCAL, salt="s")


def test_nothing_delivered_means_retry_tokens_delivered_means_migrate():
    t = tracked()
    assert plan_recovery(t, migration=True, max_attempts=3) is Recovery.RETRY
    assert plan_recovery(t, migration=False, max_attempts=3) is Recovery.RETRY
    t.absorb(EngineCoreOutput("r", [7, 8], num_cached_tokens=0))
    assert plan_recovery(t, migration=True, max_attempts=3) is Recovery.MIGRATE
    assert plan_recovery(t, migration=False, max_attempts=3) is Recovery.FAIL
    t.attempts = 3
    assert plan_recovery(t, migration=True, max_attempts=3) is Recovery.FAIL


def test_partial_prompt_logprobs_cannot_be_resumed():
    t = tracked(prompt_logprobs=1)
    t.absorb(EngineCoreOutput("r", [], prompt_logprobs=[]))
    assert plan_recovery(t, True, 3) is Recovery.RETRY  # an empty list delivered nothing
    from kiln.engine.contract import TokenLogprobs
    t.absorb(EngineCoreOutput("r", [], prompt_logprobs=[TokenLogprobs(2, -1.0, 1, [], [])]))
    assert plan_recovery(t, True, 3) is Recovery.FAIL


def test_the_continuation_resumes_after_what_was_delivered():
    t = tracked(prompt_logprobs=2)
    t.absorb(EngineCoreOutput("r", [7, 8]))
    c = t.continuation()
    assert c.prompt_token_ids == [1, 2, 3] and c.output_token_ids == [7, 8]
    assert c.params.max_tokens == 8 and c.params.prompt_logprobs is None
    assert c.cache_salt == "s" and t.resume_tokens() == [1, 2, 3, 7, 8]


def test_later_legs_report_the_first_legs_cached_tokens():
    t = tracked()
    t.absorb(EngineCoreOutput("r", [7], num_cached_tokens=16))
    out = t.absorb(EngineCoreOutput("r", [8], num_cached_tokens=32))
    assert out.num_cached_tokens == 16 and t.produced == [7, 8]


def test_a_prefill_leg_is_one_token_and_may_end_the_request():
    t = tracked(max_tokens=8, min_tokens=3)
    p = prefill_request(t.request)
    assert (p.params.max_tokens, p.params.min_tokens, p.cache_salt) == (1, 1, "s")
    first = EngineCoreOutput("r", [7], finish_reason="length")
    t.absorb(first)
    assert not t.prefill_completes(first, max_model_len=100)
    assert t.prefill_completes(first, max_model_len=4)  # 3 + 1 tokens: the context is full
    assert t.prefill_completes(EngineCoreOutput("r", [2], finish_reason="stop"), 100)
    one = tracked(max_tokens=1)
    one.absorb(first)
    assert one.prefill_completes(first, 100)
    assert without_finish(first).finish_reason is None and without_finish(first).new_token_ids == [7]
