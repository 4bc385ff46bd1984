"""Two workers behind the kv-aware router: a repeated prefix lands where it is cached, the
debug endpoint explains without routing, and a dropped KV event is repaired by a resync."""

from __future__ import annotations

import httpx

from tests.cluster.conftest import TENANT_B, tokens, wait_for, worker_metric

BLOCK = 16


def complete(server, prompt: list[int], max_tokens: int = 4) -> dict:
    r = server.http().post("/v1/completions", json={
        "model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()


def test_a_repeated_prefix_goes_to_the_worker_that_holds_it(agg):
    prefixes = [tokens(seed, 10 * BLOCK) for seed in range(4)]
    for prefix in prefixes:
        complete(agg, prefix)
    decisions = worker_metric(agg, "router_decisions_total")
    assert set(decisions) == {"worker-0", "worker-1"}  # the cold prefixes spread out

    def indexed() -> bool:
        blocks = worker_metric(agg, "worker_kv_index_blocks")
        return sum(blocks.values()) >= 4 * 10
    wait_for(indexed, 10, agg, "the KV index learning every prefix")
    for prefix in prefixes:  # each repeat hits its whole prefix: it went to the holder
        usage = complete(agg, prefix + tokens(99, 5))["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == 10 * BLOCK


def test_the_debug_endpoint_explains_without_routing(agg):
    text = "The quick brown fox jumps over the lazy dog. Paris is the capital of France. " * 4
    agg.http().post("/v1/completions", json={"model": "m", "prompt": text, "max_tokens": 2})
    question = text + "Large language models predict the next token."
    prompt = agg.http().post("/tokenize", json={"prompt": question}).json()["tokens"]
    before = {k: v for k, v in agg.metrics().items() if "router_decisions" in k}

    def explained() -> dict:
        r = agg.http().post("/debug/route", json={"prompt": question})
        assert r.status_code == 200, r.text
        return r.json()
    wait_for(lambda: max(s["cached_blocks"] for s in explained()["decision"]["scores"]) > 0,
             10, agg, "the index learning the prefix")
    body = explained()
    decision = body["decision"]
    assert body["mode"] == "aggregated" and decision["policy"] == "kv-aware"
    assert decision["prompt_blocks"] == (len(prompt) - 1) // BLOCK
    chosen = next(s for s in decision["scores"] if s["worker_id"] == decision["chosen"])
    other = next(s for s in decision["scores"] if s["worker_id"] != decision["chosen"])
    assert chosen["cached_blocks"] >= 3 and other["cached_blocks"] == 0
    assert chosen["cost"] < other["cost"] and chosen["probability"] == 1.0
    after = {k: v for k, v in agg.metrics().items() if "router_decisions" in k}
    assert after == before  # explaining routed nothing


def test_a_dropped_kv_event_triggers_a_resync(agg):
    """Every worker of `agg` drops its event batch 2; the index must still end up agreeing
    with each worker's prefix cache."""
    for seed in range(20, 24):
        complete(agg, tokens(seed, 3 * BLOCK), max_tokens=20)
    workers = 2
    assert agg.metrics()["kiln:kv_index_resyncs_total"] > workers  # more than the joins

    def consistent() -> bool:
        index = worker_metric(agg, "worker_kv_index_blocks")
        cached = worker_metric(agg, "worker_kv_cache_blocks_cached")
        return len(index) == workers and index == cached
    wait_for(consistent, 10, agg, "the index agreeing with the workers' caches")
    assert "KV event gap" in agg.log_path.read_text()


def test_tenants_never_share_cache_through_the_router(agg):
    """Paired: tenant A's repeat hits its prefix (through the router); tenant B's identical
    prompt finds nothing on any worker, and the router sees no cached block for B."""
    prompt = tokens(77, 8 * BLOCK)
    complete(agg, prompt)
    wait_for(lambda: complete(agg, prompt)["usage"]["prompt_tokens_details"]["cached_tokens"]
             >= 7 * BLOCK, 10, agg, "tenant A hitting its own prefix")
    b = httpx.Client(base_url=agg.base_url, timeout=60,
                     headers={"Authorization": f"Bearer {TENANT_B}"})
    text = agg.http().post("/detokenize", json={"tokens": prompt}).json()["prompt"]
    r = b.post("/debug/route", json={"prompt": text, "add_special_tokens": False})
    assert [s["cached_blocks"] for s in r.json()["decision"]["scores"]] == [0, 0]
    body = {"model": "m", "prompt": prompt, "max_tokens": 2, "temperature": 0}
    r = b.post("/v1/completions", json=body)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    # a client cannot pick a salt: a body `cache_salt` is ignored (B then hits B's own blocks)
    wait_for(lambda: b.post("/v1/completions", json={**body, "cache_salt": "x"}).json()[
        "usage"]["prompt_tokens_details"]["cached_tokens"] >= 7 * BLOCK, 10, agg,
        "tenant B hitting its own prefix")
