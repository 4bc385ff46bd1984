"""Metric arithmetic of `kiln bench` on hand-built records (exact values, no server)."""

from __future__ import annotations

import numpy as np
import pytest

from kiln.bench.config import SLO, parse_slo
from kiln.bench.metrics import (
    Distribution,
    ErrorKind,
    RequestRecord,
    compute_metrics,
    median_interval,
    meets_slo,
)
from kiln.bench.runner import arrival_offsets


def record(rid: int, ttft: float = 0.1, e2e: float = 0.5, out: int = 5, prompt: int = 10,
           cached: int | None = None, error: str | None = None) -> RequestRecord:
    if error is not None:
        return RequestRecord(rid, rid, 0, 0.0, out, prompt, error=error)
    gaps = tuple([(e2e - ttft) / (out - 1)] * (out - 1)) if out > 1 else ()
    return RequestRecord(rid, rid, 0, 0.0, out, prompt, ttft_s=ttft, e2e_s=e2e, itl_s=gaps,
                         prompt_tokens=prompt, output_tokens=out, cached_tokens=cached)


def test_tpot_is_decode_time_over_output_minus_one():
    assert record(0, ttft=0.1, e2e=0.5, out=5).tpot_s == pytest.approx(0.1)
    assert record(0, ttft=0.1, e2e=0.1, out=1).tpot_s is None
    assert record(0, error=ErrorKind.TIMEOUT).tpot_s is None


def test_throughputs_and_token_totals():
    records = [record(0, out=4, prompt=10), record(1, out=6, prompt=20),
               record(2, error=ErrorKind.http(503))]
    m = compute_metrics(records, duration_s=2.0, slo=SLO())
    assert (m.completed, m.failed) == (2, 1)
    assert m.errors == {"http_503": 1}
    assert (m.total_input_tokens, m.total_output_tokens) == (30, 10)
    assert m.request_throughput == pytest.approx(1.0)
    assert m.output_throughput == pytest.approx(5.0)
    assert m.total_token_throughput == pytest.approx(20.0)
    assert m.goodput is None and m.good_requests is None


def test_latency_distributions_in_ms():
    records = [record(i, ttft=t, e2e=t + 0.4, out=5) for i, t in enumerate([0.1, 0.2, 0.3])]
    m = compute_metrics(records, 1.0, SLO())
    assert m.ttft_ms is not None and m.tpot_ms is not None and m.itl_ms is not None
    assert m.ttft_ms.p50 == pytest.approx(200.0)
    assert m.ttft_ms.mean == pytest.approx(200.0)
    assert m.ttft_ms.p99 == pytest.approx(float(np.percentile([100, 200, 300], 99)))
    assert m.tpot_ms.p50 == pytest.approx(100.0)
    assert m.itl_ms.count == 3 * 4  # every gap of every request
    assert m.e2e_ms is not None and m.e2e_ms.max == pytest.approx(700.0)


def test_failed_requests_do_not_enter_latencies():
    m = compute_metrics([record(0, error=ErrorKind.SSE_ERROR)], 1.0, SLO())
    assert m.ttft_ms is None and m.itl_ms is None and m.request_throughput == 0.0
    assert m.errors == {ErrorKind.SSE_ERROR: 1}


def test_goodput_counts_requests_meeting_every_slo():
    slo = SLO(ttft_ms=150, tpot_ms=50)
    records = [
        record(0, ttft=0.1, e2e=0.3, out=5),  # ttft 100, tpot 50: good (limits inclusive)
        record(1, ttft=0.2, e2e=0.3, out=5),  # ttft 200: bad
        record(2, ttft=0.1, e2e=0.9, out=5),  # tpot 200: bad
        record(3, ttft=0.1, e2e=0.1, out=1),  # one token: tpot counts as 0, good
        record(4, error=ErrorKind.TIMEOUT),  # failures are never good
    ]
    assert [meets_slo(r, slo) for r in records] == [True, False, False, True, False]
    m = compute_metrics(records, duration_s=4.0, slo=slo)
    assert m.good_requests == 2
    assert m.goodput == pytest.approx(0.5)


def test_e2e_slo():
    assert meets_slo(record(0, e2e=0.5), SLO(e2e_ms=500))
    assert not meets_slo(record(0, e2e=0.5), SLO(e2e_ms=499))


def test_cached_token_ratio_over_requests_that_report_it():
    records = [record(0, prompt=100, cached=50), record(1, prompt=300, cached=250),
               record(2, prompt=1000, cached=None)]
    m = compute_metrics(records, 1.0, SLO())
    assert m.cached_tokens == 300
    assert m.cached_token_ratio == pytest.approx(300 / 400)
    assert compute_metrics([record(0)], 1.0, SLO()).cached_token_ratio is None


def test_parse_slo():
    assert parse_slo("ttft=500,tpot=50") == SLO(ttft_ms=500, tpot_ms=50)
    assert parse_slo("e2el=9000") == SLO(e2e_ms=9000)
    assert parse_slo(None) == SLO() and not SLO().any
    for bad in ("ttft", "foo=1", "ttft=-3"):
        with pytest.raises(ValueError):
            parse_slo(bad)


def test_distribution_of_nothing_is_none():
    assert Distribution.of_seconds([]) is None


def test_poisson_arrivals_have_the_requested_rate():
    offsets = arrival_offsets(4000, rate=8.0, burstiness=1.0, rng=np.random.default_rng(0))
    gaps = np.diff(offsets)
    assert offsets[0] == 0.0
    assert gaps.mean() == pytest.approx(1 / 8.0, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.1)  # exponential: CV 1


def test_burstiness_changes_spread_not_rate():
    gaps = np.diff(arrival_offsets(4000, 8.0, 4.0, np.random.default_rng(0)))
    assert gaps.mean() == pytest.approx(1 / 8.0, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(0.5, rel=0.1)  # gamma: CV 1/sqrt(shape)
    assert arrival_offsets(3, None, 1.0, np.random.default_rng(0)) == [0.0, 0.0, 0.0]


def test_median_interval_covers_the_median_and_narrows_with_more_repetitions():
    rng = np.random.default_rng(0)
    few, many = rng.normal(1.0, 0.1, 9).tolist(), rng.normal(1.0, 0.1, 36).tolist()
    lo, hi = median_interval(few)
    assert lo <= float(np.median(few)) <= hi
    assert median_interval(few) == (lo, hi)  # seeded: a report is reproducible
    lo36, hi36 = median_interval(many)
    assert lo36 <= float(np.median(many)) <= hi36
    assert hi36 - lo36 < hi - lo
    # a constant has no spread; one far outlier barely moves a median's interval
    assert median_interval([1.0] * 5) == (1.0, 1.0)
    assert median_interval([*many, 50.0])[1] < 1.2
    with pytest.raises(ValueError):
        median_interval([])
