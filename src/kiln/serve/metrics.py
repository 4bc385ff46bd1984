"""Prometheus metrics, all prefixed `kiln:` (GET /metrics).

Request metrics are recorded by the gateway as requests run; engine metrics are read from the
worker's latest stats at scrape time (they reset when a worker restarts, which Prometheus
treats as a counter reset). Each server has its own registry (no process-global state).

  kiln:num_requests_running / _waiting      engine sequences (gauges)
  kiln:num_requests_open                    sequences admitted by the gateway, not finished
  kiln:time_to_first_token_seconds          histogram
  kiln:inter_token_latency_seconds          histogram, per delivered batch of tokens
  kiln:e2e_request_latency_seconds          histogram
  kiln:prompt_tokens_total, kiln:generation_tokens_total, kiln:prompt_tokens_cached_total
  kiln:request_cost_usd_total               billed USD
  kiln:request_success_total{finished_reason}  finished sequences (stop, length, abort, ...)
  kiln:prefix_cache_queries_total / _hits_total  prompt tokens looked up / found; and
  kiln:prefix_cache_hit_rate                hits / queries since the worker started
  kiln:kv_cache_blocks_used / _cached / _total, kiln:kv_cache_usage_ratio
  kiln:num_preemptions_total
  kiln:worker_ready (1/0), kiln:worker_restarts_total
  kiln:cpu_info{model, isa, level}          1; this host's CPU, its ISA comma-separated (kiln.kernels.isa)
  kiln:spec_decode_num_draft_tokens_total / _num_accepted_tokens_total / _num_verify_steps_total
                                            speculative decoding (mean accepted length =
                                            accepted / verify steps)
  kiln:spec_decode_num_draft_tokens_per_pos_total{position} / _num_accepted_tokens_per_pos_total
                                            the same per draft position (acceptance rate of
                                            position i = accepted / drafted there)
  kiln:spec_decode_num_draft_tokens_by_source_total{source} / _num_accepted_tokens_by_source_total
                                            the same by who drafted (ngram = lookup, draft,
                                            head: with --ngram-first, lookup and the model)
  kiln:repetition_guard_trips_total{action}  repetition guard: stop (stop_reason repetition),
                                            retry (the looping token redrawn once), or mask
                                            (a constrained request's token banned and redrawn:
                                            a loop or a JSON limit, kiln.structured.json_limits)
  kiln:structured_closings_total            JSON-constrained sequences the closing budget
                                            steered to close their JSON within max_tokens
                                            (kiln.structured.closing; tokens per request in
                                            usage.json_closing_steered)
  kiln:grammar_compile_seconds              grammar compiles (cache misses) checking requests
  kiln:http_errors_total{status}            error responses but /health's (and stream errors)
  kiln:moe_expert_tokens_total{layer, expert}  routed (token, expert) pairs per expert of each
                                            MoE layer (from the workers' heartbeats)
  kiln:moe_expert_imbalance{layer}          max / mean of those per layer (1.0 = even)
  kiln:moe_rank_tokens_total{layer, rank} / kiln:moe_rank_imbalance{layer}
                                            the same per rank, under expert parallelism

Cluster (kiln.cluster; per-worker series carry a `worker` label):
  kiln:router_decisions_total{worker}       requests (and legs) routed to each worker
  kiln:router_hit_blocks                    histogram: leading prompt blocks the chosen worker
                                            held, per decision (`_sum` / `_count` = mean)
  kiln:router_prompt_blocks_total           prompt blocks of all decisions (hit ratio =
                                            router_hit_blocks_sum / this)
  kiln:kv_index_resyncs_total               snapshots asked for (new worker, event gap, lag)
  kiln:kv_transfers_total{outcome}          KV pulls ok / failed (failed ones recompute)
  kiln:kv_transfer_bytes_total, kiln:kv_transfer_seconds_total
  kiln:disagg_handoffs_total                prefill -> decode handoffs
  kiln:requests_retried_total / _migrated_total / _lost_total   after a worker was lost
  kiln:workers_ready                        registered workers
  kiln:worker_kv_cache_blocks_used{worker}, kiln:worker_kv_blocks_held{worker},
  kiln:worker_kv_cache_blocks_cached{worker} (what the worker's prefix cache holds),
  kiln:worker_requests_open{worker}, kiln:worker_num_requests_running{worker},
  kiln:worker_kv_index_blocks{worker}       per-worker state
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kiln.cluster.engine_client import EngineClient
from kiln.cluster.messages import ExpertLoadStats
from kiln.cluster.stats import max_over_mean
from kiln.kernels.isa import cpu_isa

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                   7.5, 10.0, 20.0, 40.0, 80.0)
GRAMMAR_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)


class ServeMetrics:
    def __init__(self, client: EngineClient):
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.ttft = Histogram("kiln:time_to_first_token_seconds", "Time to the first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("kiln:inter_token_latency_seconds", "Time between token batches",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("kiln:e2e_request_latency_seconds", "Request latency",
                             buckets=E2E_BUCKETS, registry=r)
        self.prompt_tokens = Counter("kiln:prompt_tokens", "Prompt tokens", registry=r)
        self.generation_tokens = Counter("kiln:generation_tokens", "Generated tokens",
                                         registry=r)
        self.cached_tokens = Counter("kiln:prompt_tokens_cached", "Prompt tokens from cache",
                                     registry=r)
        self.cost = Counter("kiln:request_cost_usd", "Billed USD", registry=r)
        self.finished = Counter("kiln:request_success", "Finished sequences by reason",
                                ["finished_reason"], registry=r)
        self.http_errors = Counter("kiln:http_errors", "Error responses by status", ["status"],
                                   registry=r)
        self.spec_drafts = Counter("kiln:spec_decode_num_draft_tokens",
                                   "Draft tokens verified (speculative decoding)", registry=r)
        self.spec_accepted = Counter("kiln:spec_decode_num_accepted_tokens",
                                     "Draft tokens accepted", registry=r)
        self.spec_verify_steps = Counter("kiln:spec_decode_num_verify_steps",
                                         "Sequence-steps that verified drafts", registry=r)
        self.spec_drafted_per_pos = Counter(
            "kiln:spec_decode_num_draft_tokens_per_pos",
            "Draft tokens verified at each draft position (0 = a step's first draft)",
            ["position"], registry=r)
        self.spec_accepted_per_pos = Counter(
            "kiln:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted at each draft position (0 = a step's first draft)",
            ["position"], registry=r)
        self.spec_drafted_by_source = Counter(
            "kiln:spec_decode_num_draft_tokens_by_source",
            "Draft tokens verified by who drafted them (ngram = lookup, draft, head)",
            ["source"], registry=r)
        self.spec_accepted_by_source = Counter(
            "kiln:spec_decode_num_accepted_tokens_by_source",
            "Draft tokens accepted by who drafted them (ngram = lookup, draft, head)",
            ["source"], registry=r)
        self.guard_trips = Counter("kiln:repetition_guard_trips",
                                   "Repetition-guard trips: stop (sequence ended), retry "
                                   "(looping token redrawn) or mask (constrained request: "
                                   "token banned and redrawn)", ["action"], registry=r)
        self.structured_closings = Counter(
            "kiln:structured_closings",
            "JSON-constrained sequences steered to close their JSON within max_tokens",
            registry=r)
        self.grammar_compile = Histogram("kiln:grammar_compile_seconds",
                                         "Grammar compile time (cache misses, gateway check)",
                                         buckets=GRAMMAR_BUCKETS, registry=r)
        isa = cpu_isa()
        Gauge("kiln:cpu_info", "This host's CPU: model, instruction sets, matmul level",
              ["model", "isa", "level"], registry=r).labels(
            isa.model_name, ",".join(isa.extensions), isa.level).set(1)
        r.register(EngineCollector(client))
        if hasattr(client, "counters"):  # a ClusterClient (kiln.cluster.cluster_client)
            r.register(ClusterCollector(client))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class EngineCollector(Collector):
    """Engine gauges and counters from the client's latest worker stats, read per scrape."""

    def __init__(self, client: EngineClient):
        self.client = client

    def collect(self) -> Iterator[Metric]:
        s, c = self.client.stats, self.client
        yield _gauge("num_requests_running", "Sequences running in the engine", s.num_running)
        yield _gauge("num_requests_waiting", "Sequences waiting in the engine", s.num_waiting)
        yield _gauge("num_requests_open", "Sequences admitted, not finished", c.num_open)
        yield _gauge("kv_cache_blocks_used", "KV blocks held by requests", s.kv_blocks_used)
        yield _gauge("kv_cache_blocks_cached", "KV blocks holding cached prefixes",
                     s.kv_blocks_cached)
        yield _gauge("kv_cache_blocks_total", "KV blocks in the pool", s.kv_blocks_total)
        yield _gauge("kv_cache_usage_ratio", "Share of KV blocks held by requests",
                     s.kv_blocks_used / s.kv_blocks_total if s.kv_blocks_total else 0.0)
        yield _gauge("prefix_cache_hit_rate", "Prompt tokens found in the prefix cache",
                     s.prefix_hit_tokens / s.prefix_query_tokens if s.prefix_query_tokens else 0)
        yield _counter("prefix_cache_queries", "Prompt tokens looked up", s.prefix_query_tokens)
        yield _counter("prefix_cache_hits", "Prompt tokens found cached", s.prefix_hit_tokens)
        yield _counter("num_preemptions", "Sequences preempted", s.num_preemptions)
        yield _gauge("worker_ready", "1 while the worker is ready", int(c.ready))
        yield _counter("worker_restarts", "Worker restarts", getattr(c, "num_restarts", 0))
        if s.expert_load is not None:
            yield from expert_load_metrics(s.expert_load)


class ClusterCollector(Collector):
    """Routing, KV index, transfer and failover figures of a ClusterClient, per scrape."""

    def __init__(self, client):
        self.client = client

    def collect(self) -> Iterator[Metric]:
        c, k, s = self.client, self.client.counters, self.client.stats
        decisions = CounterMetricFamily("kiln:router_decisions", "Routing decisions by worker",
                                        labels=["worker"])
        for worker, n in sorted(k.decisions.items()):
            decisions.add_metric([worker], n)
        yield decisions
        yield _hit_histogram(k)
        yield _counter("router_prompt_blocks", "Prompt blocks routed", k.prompt_blocks_sum)
        yield _counter("kv_index_resyncs", "KV index snapshots asked for", c.index.num_resyncs)
        transfers = CounterMetricFamily("kiln:kv_transfers", "KV pulls by outcome",
                                        labels=["outcome"])
        transfers.add_metric(["ok"], s.kv_transfers_ok)
        transfers.add_metric(["failed"], s.kv_transfers_failed)
        yield transfers
        yield _counter("kv_transfer_bytes", "KV bytes imported", s.kv_transfer_bytes)
        yield _counter("kv_transfer_seconds", "Seconds spent pulling KV", s.kv_transfer_seconds)
        yield _counter("disagg_handoffs", "Prefill -> decode handoffs", k.handoffs)
        yield _counter("requests_retried", "Resent after a lost worker", k.retries)
        yield _counter("requests_migrated", "Resumed mid-stream elsewhere", k.migrations)
        yield _counter("requests_lost", "Failed with their lost worker", k.lost)
        yield _gauge("workers_ready", "Registered workers", len(c.worker_handles()))
        yield from self._per_worker()

    def _per_worker(self) -> Iterator[Metric]:
        c = self.client
        families = {
            "kv_cache_blocks_used": ("KV blocks held by requests", lambda h: h.stats.kv_blocks_used),
            "kv_blocks_held": ("KV blocks pinned for transfers", lambda h: h.stats.kv_blocks_held),
            "kv_cache_blocks_cached": ("KV blocks holding cached prefixes",
                                       lambda h: h.stats.kv_blocks_cached),
            "requests_open": ("Requests routed there, open",
                              lambda h: c.router.loads.num_open(h.worker_id)),
            "num_requests_running": ("Sequences running", lambda h: h.stats.num_running),
            "kv_index_blocks": ("Blocks the KV index says it holds",
                                lambda h: c.index.num_blocks(h.worker_id)),
        }
        for name, (doc, value) in families.items():
            family = GaugeMetricFamily(f"kiln:worker_{name}", doc, labels=["worker"])
            for h in c.worker_handles():
                family.add_metric([h.worker_id], value(h))
            yield family


def expert_load_metrics(load: ExpertLoadStats) -> Iterator[Metric]:
    """Per-expert (and, under expert parallelism, per-rank) routed pairs of each MoE layer,
    and their imbalance figures (max / mean)."""
    yield from _load_families("expert", "expert", load.layers, load.tokens)
    if load.rank_tokens is not None:
        yield from _load_families("rank", "rank", load.layers, load.rank_tokens)


def _load_families(what: str, label: str, layers: list[int],
                   rows: list[list[int]]) -> Iterator[Metric]:
    tokens = CounterMetricFamily(f"kiln:moe_{what}_tokens",
                                 f"Routed (token, expert) pairs per {what} of each MoE layer",
                                 labels=["layer", label])
    imbalance = GaugeMetricFamily(f"kiln:moe_{what}_imbalance",
                                  f"Max / mean routed pairs per {what} (1.0 = even)",
                                  labels=["layer"])
    for layer, counts in zip(layers, rows, strict=True):
        for index, n in enumerate(counts):
            tokens.add_metric([str(layer), str(index)], n)
        imbalance.add_metric([str(layer)], max_over_mean(counts))
    yield tokens
    yield imbalance


def _hit_histogram(k) -> HistogramMetricFamily:
    from kiln.cluster.stats import HIT_BUCKETS

    cumulative, buckets = 0, []
    for bound, n in zip((*HIT_BUCKETS, float("inf")), k.hit_blocks, strict=True):
        cumulative += n
        buckets.append(("+Inf" if bound == float("inf") else str(bound), cumulative))
    return HistogramMetricFamily("kiln:router_hit_blocks", "Cached prompt blocks per decision",
                                 buckets=buckets, sum_value=k.hit_blocks_sum)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"kiln:{name}", doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(f"kiln:{name}", doc, value=value)


class ErrorCounter:
    """ASGI middleware counting every response with status >= 400 (outermost, so 401 and
    413 from the other middleware count too), except /health probes (a 503 there is state,
    not a failed request)."""

    def __init__(self, app: ASGIApp, metrics: ServeMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] == "/health":
            return await self.app(scope, receive, send)

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start" and message["status"] >= 400:
                self.metrics.http_errors.labels(str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)
