"""Disaggregated prefill/decode on a tiny DeepSeek-V3: the prefill worker's MLA latent blocks
travel to the decode worker, which continues exactly as one in-process engine does."""

from __future__ import annotations

import pytest

from kiln import LLM, SamplingParams
from tests.cluster.conftest import start_cluster, tokens, wait_for, worker_metric
from tests.cluster.test_disagg import DISAGG, generate
from tests.parity.test_mla_parity import make_tiny_deepseek

PROMPTS = [tokens(70 + i, n) for i, n in enumerate((40, 97))]


@pytest.fixture(scope="module")
def mla_path(tmp_path_factory):
    return make_tiny_deepseek(tmp_path_factory.mktemp("deepseek"), "yarn")


def test_latent_blocks_transfer_and_the_continuation_is_the_same(mla_path, tmp_path_factory):
    llm = LLM(mla_path, dtype="float32", num_threads=1, kv_cache_memory=8 << 20)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    expected = [o.outputs[0].text for o in
                llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)]
    del llm
    srv = start_cluster(mla_path, tmp_path_factory.mktemp("mla-disagg"), *DISAGG)
    try:
        for prompt, text in zip(PROMPTS, expected, strict=True):
            reply = generate(srv, prompt)
            assert reply["choices"][0]["text"] == text
            assert reply["usage"]["completion_tokens"] == 24
        m = srv.metrics()
        assert m['kiln:kv_transfers_total{outcome="ok"}'] == len(PROMPTS)
        assert m['kiln:kv_transfers_total{outcome="failed"}'] == 0
        wait_for(lambda: sum(worker_metric(srv, "worker_kv_blocks_held").values()) == 0, 5,
                 srv, "held blocks released")
    finally:
        srv.stop()
