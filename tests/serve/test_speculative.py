"""`kiln serve --speculator` (or vLLM's `--speculative-config`): drafts verified per response
(usage extension) and in /metrics."""

from __future__ import annotations

import pytest

from tests.serve.conftest import start_server


@pytest.mark.parametrize("flags", [("--speculator", "ngram"),
                                   ("--speculative-config",
                                    '{"method": "ngram", "prompt_lookup_max": 4}')])
def test_served_speculation_reports_usage_and_metrics(flags, llama_path, tmp_path):
    server = start_server(llama_path, tmp_path, *flags,
                          "--served-model-name", "tiny", step_delay_s=0.0)
    try:
        with server.http() as http:
            body = http.post("/v1/completions", json={
                "model": "tiny", "prompt": "The quick brown fox", "max_tokens": 48,
                "temperature": 0, "ignore_eos": True}).json()
        spec = body["usage"]["speculative"]  # the tiny model repeats itself: lookups hit
        assert spec["draft_tokens"] > 0 and spec["verify_steps"] > 0
        assert 0 < spec["accepted_tokens"] <= spec["draft_tokens"]
        assert spec["mean_accepted_length"] == spec["accepted_tokens"] / spec["verify_steps"]
        assert body["usage"]["completion_tokens"] == 48
        metrics = server.metrics()
        assert metrics["kiln:spec_decode_num_draft_tokens_total"] == spec["draft_tokens"]
        assert metrics["kiln:spec_decode_num_accepted_tokens_total"] == spec["accepted_tokens"]
        assert metrics["kiln:spec_decode_num_verify_steps_total"] == spec["verify_steps"]
        per_pos = {kind: [v for k, v in sorted(metrics.items()) if k.startswith(
            f"kiln:spec_decode_num_{kind}_tokens_per_pos_total{{")]
            for kind in ("draft", "accepted")}
        assert sum(per_pos["draft"]) == spec["draft_tokens"] and 1 <= len(per_pos["draft"]) <= 3
        assert sum(per_pos["accepted"]) == spec["accepted_tokens"]
        assert per_pos["draft"][0] == spec["verify_steps"]
        by_source = {k: v for k, v in metrics.items() if "_by_source_total{" in k}
        assert by_source == {
            'kiln:spec_decode_num_draft_tokens_by_source_total{source="ngram"}':
                spec["draft_tokens"],
            'kiln:spec_decode_num_accepted_tokens_by_source_total{source="ngram"}':
                spec["accepted_tokens"]}
    finally:
        server.stop()
