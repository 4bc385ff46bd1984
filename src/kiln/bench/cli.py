"""`kiln bench serve | plot | compare` (and `offline`, `sim` where those modules exist)."""

from __future__ import annotations

import argparse
import importlib
import math
import os
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from kiln.bench.config import (
    WORKLOAD_DEFAULTS,
    BenchConfig,
    Endpoint,
    LoadConfig,
    ServerConfig,
    WorkloadConfig,
    WorkloadKind,
    parse_slo,
)

if TYPE_CHECKING:
    from kiln.bench.compare import RoundResult
    from kiln.bench.runner import RunOptions

T = TypeVar("T")

# bench sub-commands owned by other modules, registered when importable
OPTIONAL_MODULES = ("kiln.bench.offline", "kiln.bench.sim")


def register(subparsers: argparse._SubParsersAction) -> None:
    bench = subparsers.add_parser("bench", help="benchmark a server (load, plots, comparisons)")
    bench.set_defaults(func=lambda _args: _help(bench))
    sub = bench.add_subparsers(dest="bench_command", metavar="BENCH_COMMAND")
    _register_serve(sub)
    _register_plot(sub)
    _register_compare(sub)
    for module_name in OPTIONAL_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            continue
        module.register(sub)


def _help(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 2


# ---- sub-command parsers -------------------------------------------------------------------

def _register_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="load-test an OpenAI-compatible server",
                       description="Stream a seeded workload at an OpenAI-compatible server "
                                   "and record TTFT, TPOT, ITL, E2E, throughput and goodput.")
    p.add_argument("--base-url", required=True, help="server root, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", required=True, help="model name sent with each request")
    p.add_argument("--label", help="series name in plots (default: model @ base URL)")
    _add_server_args(p)
    _add_workload_args(p)
    _add_load_args(p)
    p.add_argument("--out", required=True, type=Path, help="result JSON file")
    p.set_defaults(func=_serve)


def _register_plot(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plot", help="latency-throughput curves and CDFs from result files")
    p.add_argument("files", nargs="+", type=Path, help="result JSON files of `kiln bench serve`")
    p.add_argument("--out", required=True, type=Path, help="PNG file to write")
    p.set_defaults(func=_plot)


def _register_compare(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("compare", help="one workload against two servers, alternating rounds")
    p.add_argument("--a", required=True, metavar="URL", help="base URL of server A")
    p.add_argument("--b", required=True, metavar="URL", help="base URL of server B")
    p.add_argument("--model", help="model name for both servers")
    p.add_argument("--a-model", help="model name for A (default --model)")
    p.add_argument("--b-model", help="model name for B (default --model)")
    p.add_argument("--a-label", help="name of A in the table (default model @ URL)")
    p.add_argument("--b-label", help="name of B in the table")
    p.add_argument("--rounds", type=int, default=3, help="A/B rounds; medians are compared")
    _add_server_args(p)
    _add_workload_args(p)
    _add_load_args(p)
    p.add_argument("--out", required=True, type=Path, help="comparison JSON file")
    p.set_defaults(func=_compare)


def _add_server_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("requests")
    g.add_argument("--endpoint", choices=[e.value for e in Endpoint], default="chat",
                   help="chat: /v1/chat/completions; completions: /v1/completions")
    g.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="send ignore_eos so replies have their full output length")
    g.add_argument("--request-timeout", type=float, default=600.0, metavar="S")
    g.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature of every request (default 0: greedy; vLLM's "
                   "`vllm bench serve` sends none, i.e. the server's default of 1.0)")
    g.add_argument("--api-key", default=None,
                   help="bearer token (default: $KILN_API_KEY or $OPENAI_API_KEY)")
    g.add_argument("--tokenizer", help="tokenizer directory used to size prompts (default: "
                   "the model if it is a local directory, else kiln's default model)")
    g.add_argument("--slo", help="ttft=MS,tpot=MS,e2e=MS: goodput counts requests meeting all")


def _add_workload_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload (lengths in tokens; defaults depend on the workload)")
    g.add_argument("--workload", choices=[k.value for k in WorkloadKind], default="random")
    g.add_argument("--input-len", type=int, help="new prompt tokens per request")
    g.add_argument("--output-len", type=int, help="max_tokens per request")
    g.add_argument("--range-ratio", type=float, help="lengths uniform in len*(1 -/+ ratio)")
    g.add_argument("--groups", type=int, help="shared-prefix: number of shared prefixes")
    g.add_argument("--prompts-per-group", type=int, help="shared-prefix: prompts per prefix")
    g.add_argument("--system-len", type=int,
                   help="shared-prefix: prefix length; multi-turn: shared system prompt")
    g.add_argument("--sessions", type=int, help="multi-turn: conversations")
    g.add_argument("--turns", type=int, help="multi-turn: requests per conversation")
    g.add_argument("--first-input-len", type=int, help="multi-turn: first user message")
    g.add_argument("--dataset", help="jsonl: one request per line, {prompt|messages, "
                   "output_tokens}")


def _add_load_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("load")
    mode = g.add_mutually_exclusive_group(required=True)
    mode.add_argument("--rate", type=float, help="requests (sessions) per second; inf: all at once")
    mode.add_argument("--concurrency", type=int, help="requests (sessions) kept in flight")
    g.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of arrival gaps: 1 Poisson, <1 burstier, >1 steadier")
    g.add_argument("--num-requests", type=int, help="requests to send (default: the workload's)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--warmup", type=int, default=1, help="untimed warm-up requests")
    g.add_argument("--max-duration", type=float, metavar="S",
                   help="stop after S seconds, cancelling requests in flight")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")


# ---- args -> configs -----------------------------------------------------------------------

def workload_from_args(args: argparse.Namespace) -> WorkloadConfig:
    kind = WorkloadKind(args.workload)
    values: dict[str, object] = dict(WORKLOAD_DEFAULTS.get(kind, {}))
    for name in ("input_len", "output_len", "range_ratio", "groups", "prompts_per_group",
                 "system_len", "sessions", "turns", "first_input_len", "dataset"):
        if getattr(args, name) is not None:
            values[name] = getattr(args, name)
    return WorkloadConfig(kind=kind, **values)  # type: ignore[arg-type]


def load_from_args(args: argparse.Namespace, workload: WorkloadConfig) -> LoadConfig:
    from kiln.bench.workloads import default_num_requests

    rate = None if args.rate is None or math.isinf(args.rate) else args.rate
    return LoadConfig(
        num_requests=(args.num_requests if args.num_requests is not None
                      else default_num_requests(workload)), seed=args.seed,
        rate=rate, burstiness=args.burstiness, concurrency=args.concurrency,
        warmup_requests=args.warmup, max_duration_s=args.max_duration)


def server_from_args(args: argparse.Namespace, base_url: str, model: str) -> ServerConfig:
    return ServerConfig(base_url=base_url, model=model, endpoint=Endpoint(args.endpoint),
                        ignore_eos=args.ignore_eos, request_timeout_s=args.request_timeout,
                        temperature=args.temperature)


def bench_config_from_args(args: argparse.Namespace, server: ServerConfig,
                           label: str | None) -> BenchConfig:
    workload = workload_from_args(args)
    return BenchConfig(server=server, load=load_from_args(args, workload), workload=workload,
                       slo=parse_slo(args.slo), label=label,
                       tokenizer=_tokenizer_path(args.tokenizer, server.model))


def _tokenizer_path(tokenizer: str | None, model: str) -> str:
    from kiln.bench.tokens import resolve_tokenizer_path
    from kiln.cli import CliError
    from kiln.models.default import DefaultModelError

    try:
        return resolve_tokenizer_path(tokenizer, model)
    except DefaultModelError as exc:
        raise CliError(f"{exc} (or pass --tokenizer DIR)") from None


def _run_options(args: argparse.Namespace, config: BenchConfig) -> RunOptions:
    from kiln.bench.runner import RunOptions
    from kiln.bench.tokens import load_tokenizer

    assert config.tokenizer is not None
    if args.tokenizer is None:
        print(f"kiln bench: sizing prompts with the tokenizer in {config.tokenizer}",
              file=sys.stderr)
    api_key = args.api_key or os.environ.get("KILN_API_KEY") or os.environ.get("OPENAI_API_KEY")
    return RunOptions(tokenizer=load_tokenizer(config.tokenizer), api_key=api_key,
                      show_progress=not args.no_progress and sys.stderr.isatty())


# ---- sub-command bodies --------------------------------------------------------------------

def _serve(args: argparse.Namespace) -> int:
    from kiln.bench.report import print_summary
    from kiln.bench.result import save_result
    from kiln.bench.runner import run_benchmark

    server = server_from_args(args, args.base_url, args.model)
    config = bench_config_from_args(args, server, args.label)
    result = _guarded(lambda: run_benchmark(config, _run_options(args, config)))
    path = save_result(result, args.out)
    print_summary(result)
    print(f"wrote {path}")
    return 0


def _plot(args: argparse.Namespace) -> int:
    from kiln.bench.plot import plot_results
    from kiln.bench.result import load_result

    results = [load_result(path) for path in args.files]
    print(f"wrote {plot_results(results, args.out)}")
    return 0


def _compare(args: argparse.Namespace) -> int:
    from kiln.bench.compare import CompareConfig, print_compare, run_compare
    from kiln.bench.result import result_to_json

    a_model, b_model = args.a_model or args.model, args.b_model or args.model
    if a_model is None or b_model is None:
        raise ValueError("give --model, or both --a-model and --b-model")
    a = bench_config_from_args(args, server_from_args(args, args.a, a_model), args.a_label)
    b = replace(a, server=server_from_args(args, args.b, b_model), label=args.b_label)
    config = CompareConfig(a=a, b=b, rounds=args.rounds)
    options = _run_options(args, a)
    result = _guarded(lambda: run_compare(config, options, on_round=_print_round))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(result_to_json(result, list_key="rounds"))
    print_compare(result)
    print(f"wrote {args.out}")
    return 0


def _print_round(round_result: RoundResult) -> None:
    m = round_result.metrics
    print(f"round {round_result.round} {round_result.side.upper()}: "
          f"{m.output_throughput:.1f} tok/s, {m.completed} ok, {m.failed} failed",
          file=sys.stderr)


def _guarded(run: Callable[[], T]) -> T:
    """Run a benchmark, turning a run that cannot start into a one-line CLI error."""
    from kiln.bench.runner import BenchError
    from kiln.cli import CliError

    try:
        return run()
    except BenchError as exc:
        raise CliError(str(exc)) from None
