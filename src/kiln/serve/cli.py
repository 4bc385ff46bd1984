"""`kiln serve`: flags -> ServeConfig + WorkerConfig -> kiln.serve.server.serve."""

from __future__ import annotations

import argparse
import json
import logging

from kiln.cluster.cli import add_cluster_flags, cluster_config, threads_per_worker
from kiln.config import (
    DEFAULT_TREE_DRAFTS,
    HEAD_TREE_DRAFTS,
    HEAD_TREE_MIN_PROB,
    HEAD_TREE_WIDTH,
    MAX_TREE_DRAFTS,
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    ServeConfig,
    SpeculativeConfig,
    StructuredConfig,
    WorkerConfig,
)
from kiln.speculative.resolve import resolve_speculative_config

DEFAULTS = ServeConfig()


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server over an engine worker",
                       description="Serve a model over an OpenAI-compatible HTTP API.")
    engine_flags(p.add_argument_group("engine worker"))
    _gateway_flags(p.add_argument_group("gateway"))
    add_cluster_flags(p.add_argument_group("cluster (many workers: kiln.cluster)"))
    p.set_defaults(func=run)


def engine_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--model", default=None, help="HF checkpoint dir (default: bundled model)")
    g.add_argument("--dtype", default="auto", help="auto | bfloat16 | float16 | float32")
    g.add_argument("--max-model-len", type=int, default=None, help="prompt + output tokens")
    g.add_argument("--kv-cache-memory", type=int, default=None, help="KV cache bytes")
    g.add_argument("--max-num-seqs", type=int, default=64, help="running sequences per step")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048, help="tokens per step")
    g.add_argument("--policy", default="fcfs", choices=["fcfs", "priority"],
                   help="admission order; priority honours the request's `priority`")
    g.add_argument("--no-prefix-caching", action="store_true", help="disable prefix caching")
    g.add_argument("--quantization", default=None, help="quantize weights on load")
    g.add_argument("--threads", type=int, default=None,
                   help="torch threads per worker (default: the cores split among workers)")
    _speculative_flags(g)
    g.add_argument("--heartbeat-interval", type=float, default=WorkerConfig.heartbeat_interval_s,
                   help="seconds between worker heartbeats")
    g.add_argument("--repetition-guard", default=StructuredConfig.repetition_guard,
                   choices=["off", "stop", "retry"],
                   help="a sequence stuck repeating: stop it (finish_reason repetition), retry "
                        "(redraw the looping token once, then stop), or off; requests may override")
    g.add_argument("--grammar-compile-timeout", type=float,
                   default=StructuredConfig.compile_timeout_s,
                   help="seconds a structured-output grammar may take to compile (else 400)")


def _speculative_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--speculator", default=None,
                   help="speculative decoding: ngram, a speculator dir or preset (see "
                        "kiln train-speculator), or a draft checkpoint")
    g.add_argument("--speculative-config", default=None, metavar="JSON",
                   help="speculative decoding as vLLM's flag takes it, e.g. '{\"method\": "
                        "\"eagle\", \"model\": \"code-head\", \"num_speculative_tokens\": 3}' "
                        "(method ngram | eagle | eagle3 | draft_model, model, "
                        "prompt_lookup_min/max, disable_by_batch_size, and kiln's own "
                        "SpeculativeConfig fields); instead of --speculator, and the flags "
                        "below override it")
    g.add_argument("--num-speculative-tokens", type=int, default=None,
                   help="most draft tokens per sequence per step (default: "
                        f"{SpeculativeConfig.num_speculative_tokens})")
    g.add_argument("--ngram-first", action=argparse.BooleanOptionalAction, default=None,
                   help="with a draft model or head: take an n-gram (prompt lookup) match's "
                        "drafts when the sequence has one (with a head: in the same tree), "
                        "the model's otherwise (default: on for a head, off for a draft model)")
    g.add_argument("--speculative-tree-width", type=int, default=None,
                   help="draft trees: up to this many alternative continuations per sequence "
                        "and step, verified in one forward (n-gram lookup, head; 1 = one "
                        f"chain; default: {HEAD_TREE_WIDTH} for a head, 1 otherwise)")
    g.add_argument("--speculative-tree-size", type=int, default=None,
                   help=f"draft trees: at most this many drafts per tree (1-{MAX_TREE_DRAFTS}; "
                        f"default: {HEAD_TREE_DRAFTS} for a head, {DEFAULT_TREE_DRAFTS} "
                        "otherwise)")
    g.add_argument("--speculative-tree-min-prob", type=float, default=None,
                   help="a head's draft trees by probability: its nodes whose path "
                        "probability is at least this, up to --speculative-tree-size; 0 = a "
                        f"fixed size (default: {HEAD_TREE_MIN_PROB})")
    g.add_argument("--speculative-tree-max-batch", type=int, default=None,
                   help="draft trees only while at most this many sequences decode (default: "
                        f"{SpeculativeConfig.tree_max_batch})")
    g.add_argument("--speculative-adaptive", action=argparse.BooleanOptionalAction,
                   default=None,
                   help="choose per step how many drafts, and a tree or a chain, by measured "
                        "cost and acceptance; --no-speculative-adaptive always drafts "
                        "--num-speculative-tokens (trees wherever they are allowed)")
    g.add_argument("--speculator-int8", action=argparse.BooleanOptionalAction, default=None,
                   help="a head's or draft model's weights int8 weight-only at decode sizes "
                        "(cheaper draft steps; output is exact either way; default: on)")


def _gateway_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--host", default=DEFAULTS.host)
    g.add_argument("--port", type=int, default=DEFAULTS.port)
    g.add_argument("--api-key", action="append", default=[], help="repeatable; enables auth")
    g.add_argument("--served-model-name", default=None, help="model name clients send")
    g.add_argument("--pricing", default=None, help="JSON/TOML price table (USD per 1M tokens)")
    g.add_argument("--max-n", type=int, default=DEFAULTS.max_n)
    g.add_argument("--max-top-logprobs", type=int, default=DEFAULTS.max_top_logprobs)
    g.add_argument("--max-body-bytes", type=int, default=DEFAULTS.max_body_bytes)
    g.add_argument("--admission-queue-size", type=int, default=DEFAULTS.admission_queue_size,
                   help="sequences waiting beyond --max-num-seqs before 429")
    g.add_argument("--shutdown-timeout", type=float, default=DEFAULTS.shutdown_timeout_s,
                   help="SIGTERM: seconds to drain before aborting")
    g.add_argument("--no-restart", action="store_true", help="do not restart a dead worker")
    g.add_argument("--heartbeat-timeout", type=float, default=DEFAULTS.heartbeat_timeout_s,
                   help="silence after which the worker is declared stuck")
    g.add_argument("--access-log", action="store_true", help="log one line per request")
    g.add_argument("--tool-call-parser", default=DEFAULTS.tool_call_parser,
                   choices=["auto", "hermes", "json"],
                   help="tool-call syntax: hermes (<tool_call>{...}</tool_call>), json (a bare "
                        "object), or auto (from the chat template)")


def configs(args: argparse.Namespace) -> tuple[ServeConfig, WorkerConfig]:
    cluster = cluster_config(args)
    engine = engine_config(args, args.threads or threads_per_worker(cluster.num_spawned))
    serve = ServeConfig(
        host=args.host, port=args.port, api_keys=tuple(args.api_key),
        served_model_name=args.served_model_name, pricing_file=args.pricing,
        max_n=args.max_n, max_top_logprobs=args.max_top_logprobs,
        max_body_bytes=args.max_body_bytes, admission_queue_size=args.admission_queue_size,
        shutdown_timeout_s=args.shutdown_timeout, restart_worker=not args.no_restart,
        heartbeat_timeout_s=args.heartbeat_timeout, access_log=args.access_log, cluster=cluster,
        tool_call_parser=args.tool_call_parser)
    return serve, WorkerConfig(engine=engine, heartbeat_interval_s=args.heartbeat_interval)


def engine_config(args: argparse.Namespace, threads: int | None) -> EngineConfig:
    """The engine flags (shared with `kiln worker`) as an EngineConfig."""
    return EngineConfig(
        model=ModelConfig(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len,
                          quantization=args.quantization),
        cache=CacheConfig(kv_cache_memory=args.kv_cache_memory,
                          enable_prefix_caching=not args.no_prefix_caching),
        scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs,
                                  max_num_batched_tokens=args.max_num_batched_tokens,
                                  policy=args.policy),
        parallel=ParallelConfig(num_threads=threads),
        speculative=speculative_config(args),
        structured=StructuredConfig(repetition_guard=args.repetition_guard,
                                    compile_timeout_s=args.grammar_compile_timeout))


def speculative_config(args: argparse.Namespace) -> SpeculativeConfig | None:
    """Off unless --speculator or --speculative-config names a speculator; the speculative
    flags given on the command line override the JSON's keys."""
    flags = {"num_speculative_tokens": args.num_speculative_tokens,
             "adaptive": args.speculative_adaptive, "ngram_first": args.ngram_first,
             "tree_width": args.speculative_tree_width, "tree_size": args.speculative_tree_size,
             "tree_min_prob": args.speculative_tree_min_prob,
             "tree_max_batch": args.speculative_tree_max_batch,
             "speculator_int8": args.speculator_int8}
    given = {name: value for name, value in flags.items() if value is not None}
    if args.speculative_config is None:
        return (resolve_speculative_config(args.speculator, SpeculativeConfig(**given))
                if args.speculator else None)
    if args.speculator:
        raise ValueError("--speculator and --speculative-config both name a speculator: give "
                         "one (the JSON's \"model\" and \"method\" do what --speculator does)")
    try:
        spec = json.loads(args.speculative_config)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--speculative-config is not JSON: {exc}") from None
    if not isinstance(spec, dict):
        raise ValueError("--speculative-config must be a JSON object, e.g. "
                         "'{\"method\": \"ngram\", \"num_speculative_tokens\": 3}'")
    try:
        return resolve_speculative_config(None, {**spec, **given})
    except ValueError as exc:
        message = str(exc).removeprefix("speculative_config: ")
        raise ValueError(f"--speculative-config: {message}") from None


def run(args: argparse.Namespace) -> int:
    from kiln.serve.server import serve

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    serve_config, worker_config = configs(args)
    return serve(serve_config, worker_config)
