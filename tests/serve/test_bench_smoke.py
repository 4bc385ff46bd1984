"""`kiln bench serve` end to end against a live `kiln serve` on the tiny llama.

Two short runs at concurrency 2 (random, then shared-prefix) through the CLI entry point: every
request succeeds with exactly the output length it asked for (`ignore_eos`), the timings are
positive and consistent with each other, and the result file records the config that made it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kiln.bench.result import BenchResult, load_result
from kiln.cli import main
from tests.serve.conftest import MODEL

CONCURRENCY = 2
RANDOM = {"num_requests": 6, "input_len": 32, "output_len": 12}
# 2 prefixes x 3 prompts; a 48-token prefix spans whole 16-token KV blocks, so later prompts of
# a group find it cached.
SHARED = {"groups": 2, "prompts_per_group": 3, "system_len": 48, "input_len": 16,
          "output_len": 8}


def run_bench(server, tokenizer: str, out: Path, workload: str, sizes: dict[str, int]) -> int:
    """`kiln bench serve` against `server` with `sizes` as --flags; returns its exit code."""
    flags = [f"--{name.replace('_', '-')}={value}" for name, value in sizes.items()]
    return main(["bench", "serve", "--base-url", server.base_url, "--model", MODEL,
                 "--tokenizer", tokenizer, "--workload", workload,
                 "--concurrency", str(CONCURRENCY), "--seed", "3", "--no-progress",
                 "--out", str(out), *flags])


@pytest.fixture(scope="module")
def random_run(server, llama_path, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bench") / "random.json"
    assert run_bench(server, llama_path, out, "random", RANDOM) == 0
    return out


@pytest.fixture(scope="module")
def shared_run(server, llama_path, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bench") / "shared.json"
    assert run_bench(server, llama_path, out, "shared-prefix", SHARED) == 0
    return out


def assert_all_succeeded(result: BenchResult, num_requests: int, output_len: int) -> None:
    m = result.metrics
    assert (m.completed, m.failed, m.errors) == (num_requests, 0, {})
    assert [r.request_id for r in result.records] == list(range(num_requests))
    for r in result.records:
        assert r.ok, (r.error, r.error_detail)
        assert r.max_tokens == r.output_tokens == output_len
        # the chat template wraps the prompt text, so the server counts more tokens than it
        assert r.prompt_tokens is not None and r.prompt_tokens > r.expected_prompt_tokens
    assert m.total_output_tokens == num_requests * output_len


def assert_timings_consistent(result: BenchResult) -> None:
    for r in result.records:
        assert r.ttft_s is not None and r.e2e_s is not None
        assert 0 < r.ttft_s <= r.e2e_s
        assert r.tpot_s is not None and r.tpot_s > 0
        assert r.start_s >= 0
        # one gap per later content chunk; a token may decode to no text (a partial byte)
        assert len(r.itl_s) <= (r.output_tokens or 0) - 1
        assert all(gap >= 0 for gap in r.itl_s)
    m = result.metrics
    assert m.duration_s >= max(r.start_s + (r.e2e_s or 0) for r in result.records)
    assert m.request_throughput == pytest.approx(m.completed / m.duration_s)
    assert m.output_throughput == pytest.approx(m.total_output_tokens / m.duration_s)
    assert m.total_token_throughput > m.output_throughput > 0
    for dist in (m.ttft_ms, m.tpot_ms, m.e2e_ms):
        assert dist is not None and dist.count == m.completed
        assert 0 < dist.min <= dist.p50 <= dist.p90 <= dist.max
    assert m.ttft_ms.p50 <= m.e2e_ms.p50 and m.ttft_ms.max <= m.e2e_ms.max
    assert m.goodput is None  # no --slo given


def test_random_run_succeeds_with_exact_output_lengths(random_run):
    result = load_result(random_run)
    assert_all_succeeded(result, RANDOM["num_requests"], RANDOM["output_len"])
    assert_timings_consistent(result)
    for r in result.records:
        assert r.expected_prompt_tokens == RANDOM["input_len"]


def test_random_run_records_its_config(random_run, server, llama_path):
    raw = json.loads(random_run.read_text())
    config = raw["config"]
    assert config["server"] == {"base_url": server.base_url, "model": MODEL,
                                "endpoint": "chat", "ignore_eos": True,
                                "request_timeout_s": 600.0, "temperature": 0.0}
    assert config["load"]["num_requests"] == RANDOM["num_requests"]
    assert config["load"]["concurrency"] == CONCURRENCY and config["load"]["seed"] == 3
    assert config["load"]["rate"] is None
    workload = config["workload"]
    assert workload["kind"] == "random"
    assert (workload["input_len"], workload["output_len"]) == (32, 12)
    assert config["tokenizer"] == llama_path
    assert len(raw["records"]) == RANDOM["num_requests"]
    assert raw["environment"]["kiln_version"]


def test_shared_prefix_run_hits_the_prefix_cache(shared_run):
    result = load_result(shared_run)
    num_requests = SHARED["groups"] * SHARED["prompts_per_group"]
    assert_all_succeeded(result, num_requests, SHARED["output_len"])
    assert_timings_consistent(result)
    assert result.config.workload.system_len == SHARED["system_len"]
    m = result.metrics
    assert m.cached_tokens is not None and m.cached_tokens > 0
    assert m.cached_token_ratio is not None and 0 < m.cached_token_ratio < 1
