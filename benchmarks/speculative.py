"""Speculative decoding on the default model: decode tokens/s per proposer, domain and batch.

  python benchmarks/speculative.py [--reps 3] [--max-tokens 48] [--out results.json]

Configurations: off (and off-again, a second engine without drafts: the noise floor of a
ratio), n-gram, draft model (the `code-draft` preset), code head, prose head
(presets built by `kiln train-speculator --preset NAME`; missing ones are skipped), and each
head with `ngram_first` ("+ng": an n-gram match's drafts where the text has one); draft trees
("-tree", "+ngt": --tree-width and --tree-size, or a shape of their own, NAME@WIDTHxSIZE, so
tree shapes compare in one run: a fixed tree, the k * WIDTH likeliest nodes; NAME@WIDTHxSIZE:P
the head's nodes of path probability at least P, up to SIZE: `SpeculativeConfig.tree_min_prob`,
0.03 by default); a trailing "/full" scores every verify row with the whole LM head
(`SpeculativeConfig.verify_shortlist` off), to time the shortlist; `--head NAME=DIR` adds a head of one's own as NAME and NAME+ngt, to compare
two heads in one run. Domains:
code prompts (the opening of held-out standard-library files) and prose prompts (windows of
the held-out pages of the prose domain: the Python documentation when `python3-doc` is
installed, else the pydoc topics), never text the speculators were trained on. Batch 1 runs three
prompts one after another (`--batch1-prompts`); batches 2 and 4 (`--batches 1 2 4`) run the
same prompts in closed batches of two and four; batch 8 runs eight together (a closed batch: timed to its last
token, so it includes the ragged end where sequences that drafted well are done and the rest
decode in a smaller batch); batch 8 sustained queues sixteen for eight slots (finished ones
are refilled, as on a server under load) and times only the steps where eight sequences
decode and none prefills. Greedy decoding with ignore_eos, so
every configuration emits exactly the same tokens and only the time differs.
Speed-ups are paired: per repetition, a configuration's rate over "off"'s rate measured
moments apart in the same case, then the median over repetitions, with a 95% bootstrap
interval for that median (single paired runs of a closed batch of eight spread over
0.8-1.2x on a shared 2-core machine). `--pool A.json B.json` reports earlier runs'
repetitions together.

Decode tokens/s = (tokens emitted after each request's first) / (time from the step where
the last request got its first token to the end): prefill is excluded, the proposers' own
prefill-time work is not. Tokens per CPU-second (this process's CPU time over the same span)
is reported beside it: on a shared machine it moves much less with other people's load. Every
configuration is warmed up by one untimed pass over every case, as long as the timed ones
(adaptive speculation tries each of its arms a few times per batch-size bucket first: a pass
of 16 tokens left some of that for the timed repetitions, costing closed prose batches of 8
with a head and lookup about 4%), then the configurations run interleaved, in a shuffled
order per repetition, and the median is reported. The machine is shared and noisy: figures are
indicative.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from transformers import AutoTokenizer  # noqa: F401  (import before engines start threads)

from kiln import LLM, SamplingParams
from kiln.bench.metrics import median_interval
from kiln.bench.result import cpu_summary
from kiln.config_speculative import MAX_TREE_DRAFTS, MAX_TREE_WIDTH, SpeculativeConfig
from kiln.engine.core import EngineRequest
from kiln.speculative.resolve import speculator_path, speculators_home
from kiln.speculative.training.data import code_prompts, prose_prompts, prose_source

CONFIGS = {"off": None, "off-again": None, "ngram": "ngram", "draft": "code-draft",
           "code-head": "code-head",
           "prose-head": "prose-head", "code-head+ng": "code-head", "prose-head+ng": "prose-head",
           "ngram-tree": "ngram", "code-head-tree": "code-head", "prose-head-tree": "prose-head",
           "code-head+ngt": "code-head", "prose-head+ngt": "prose-head"}
# "off-again": a second engine without drafts, measured like the others: the noise floor of
# a ratio (two engines with the same weights and settings differ by a few percent here,
# however many repetitions)
# "+ng": SpeculativeConfig(ngram_first=True), an n-gram match's drafts where the text has one;
# "-tree" and "+ngt": lookup drafts trees of --tree-width continuations (not in the default
# set: `--configs off ngram ngram-tree`)
DEFAULT_CONFIGS = [n for n in CONFIGS if not n.endswith(("tree", "+ngt"))]
TREES = ("tree", "+ngt")
FULL = "/full"  # a configuration with SpeculativeConfig(verify_shortlist=False)


def extra_head(spec: str) -> str:
    """"NAME=DIR": registers a head directory as configurations NAME and NAME+ngt."""
    name, eq, path = spec.partition("=")
    if not eq or not name or name in CONFIGS or not (Path(path) / "speculator.json").is_file():
        raise argparse.ArgumentTypeError(
            f"{spec!r}: give NAME=DIR, a new name and a directory with a speculator.json")
    CONFIGS[name] = CONFIGS[f"{name}+ngt"] = path
    return spec


def config_name(name: str) -> str:
    """A configuration, optionally a tree one with its own width and size: "NAME@WxS"
    (`prose-head+ngt@8x31`), so tree shapes compare in one run; "/full" after either, the
    same without the verify shortlist."""
    base, at, shape = name.removesuffix(FULL).partition("@")
    if base not in CONFIGS:
        raise argparse.ArgumentTypeError(f"unknown configuration {base!r}; one of "
                                          f"{', '.join(CONFIGS)}")
    if at:
        shape, colon, floor = shape.partition(":")
        width, x, size = shape.partition("x")
        if not (base.endswith(TREES) and x and width.isdigit() and size.isdigit()):
            raise argparse.ArgumentTypeError(f"{name!r}: only -tree and +ngt configurations "
                                              "take a shape, as NAME@WIDTHxSIZE[:MIN_PROB]")
        if not (1 <= int(width) <= MAX_TREE_WIDTH and 1 <= int(size) <= MAX_TREE_DRAFTS):
            raise argparse.ArgumentTypeError(f"{name!r}: width in [1, {MAX_TREE_WIDTH}], size "
                                              f"in [1, {MAX_TREE_DRAFTS}]")
        try:
            if colon and not 0 < float(floor) < 1:
                raise ValueError
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name!r}: MIN_PROB (a tree by probability) "
                                              "in (0, 1)") from None
    return name


def tree_shape(name: str, args) -> tuple[int, int, float | None]:
    """(tree width, tree size, tree_min_prob) of a configuration: 1 wide unless it drafts
    trees; "NAME@WxS" a fixed tree (the k * W likeliest, up to S), "NAME@WxS:P" the head's
    nodes of path probability >= P, up to S; without a shape --tree-width, --tree-size and
    --tree-min-prob (None: the engine's defaults)."""
    base, _, shape = name.removesuffix(FULL).partition("@")
    if not base.endswith(TREES):
        return 1, args.tree_size, None
    if shape:
        shape, colon, floor = shape.partition(":")
        width, _, size = shape.partition("x")
        return int(width), int(size), float(floor) if colon else 0.0
    return args.tree_width, args.tree_size, args.tree_min_prob


@dataclass
class Run:
    decode_tokens: int
    decode_seconds: float
    cpu_seconds: float  # this process's CPU time over the same span (all its threads)
    drafts: int
    accepted: int
    verify_steps: int

    @property
    def tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_seconds

    @property
    def tokens_per_cpu_s(self) -> float:
        return self.decode_tokens / self.cpu_seconds


def submit(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple[int, int, int]:
    """Queue the prompts (greedy, EOS ignored); returns the speculator's counts before."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        llm.engine.add_request(EngineRequest(request_id=f"b{time.monotonic_ns()}-{i}",
                                             prompt_token_ids=p, params=params))
    return _spec_counts(llm)


def decode(llm: LLM, prompts: list[list[int]], max_tokens: int) -> Run:
    """Run the prompts together through the engine; time the decode phase only."""
    engine = llm.engine
    before = submit(llm, prompts, max_tokens)
    started_decode, emitted, pending_first = None, 0, len(prompts)
    while engine.has_unfinished():
        for out in engine.step():
            if out.new_token_ids and pending_first and _first(out, engine):
                pending_first -= 1
            emitted += len(out.new_token_ids)
        if started_decode is None and pending_first == 0:
            started_decode, emitted_at_start = time.perf_counter(), emitted
            started_cpu = time.process_time()
    seconds = time.perf_counter() - started_decode
    cpu = time.process_time() - started_cpu
    after = _spec_counts(llm)
    return Run(emitted - emitted_at_start, seconds, cpu,
               *(a - b for a, b in zip(after, before, strict=True)))


def decode_sustained(llm: LLM, prompts: list[list[int]], max_tokens: int, width: int) -> Run:
    """Queue every prompt at once with room for `width` sequences, so finished requests'
    slots are refilled (as a server under load sees); time only the steps where `width`
    sequences decode and nothing prefills: decode speed at that batch size, without the
    ragged end of a closed batch (where requests that drafted well finish first and the last
    steps run nearly empty)."""
    engine = llm.engine
    before = submit(llm, prompts, max_tokens)
    planned, inner = [], engine.scheduler.schedule
    engine.scheduler.schedule = lambda: planned.append(inner()) or planned[-1]
    tokens, seconds, cpu = 0, 0.0, 0.0
    try:
        while engine.has_unfinished():
            started, started_cpu = time.perf_counter(), time.process_time()
            outputs = engine.step()
            sched = planned.pop()
            if len(sched.scheduled) == width and all(
                    item.samples and len(item.token_ids) == 1 + item.num_draft_tokens
                    for item in sched.scheduled):
                seconds += time.perf_counter() - started
                cpu += time.process_time() - started_cpu
                tokens += sum(len(out.new_token_ids) for out in outputs)
    finally:
        engine.scheduler.schedule = inner
    after = _spec_counts(llm)
    return Run(tokens, seconds, cpu, *(a - b for a, b in zip(after, before, strict=True)))


def _first(out, engine) -> bool:
    request = engine.scheduler.requests.get(out.request_id)
    return request is None or request.num_output_tokens == len(out.new_token_ids)


def _spec_counts(llm: LLM) -> tuple[int, int, int]:
    s = llm.engine.speculator
    return (0, 0, 0) if s is None else (s.stats.num_draft_tokens, s.stats.num_accepted_tokens,
                                        s.stats.num_verify_steps)


def build(name: str, args) -> LLM | None:
    base = name.removesuffix(FULL).partition("@")[0]
    speculator = CONFIGS[base]
    if speculator not in (None, "ngram"):
        try:
            speculator = str(speculator_path(speculator))
        except ValueError:
            print(f"skipping {name}: no {speculators_home() / speculator} and none shipped "
                  f"(kiln train-speculator --preset {speculator})")
            return None
    width, size, min_prob = tree_shape(name, args)
    return LLM(max_model_len=1024, kv_cache_memory=96 << 20, max_num_seqs=8,
               num_threads=args.threads, speculator=speculator,
               speculative_config=SpeculativeConfig(
                   ngram_first=base.endswith(("+ng", "+ngt")),
                   tree_width=width, tree_size=size, tree_min_prob=min_prob,
                   adaptive=not args.no_adaptive,
                   num_speculative_tokens=args.num_speculative_tokens,
                   verify_shortlist=not name.endswith(FULL))
               if speculator else None)


BATCHES = ("1", "2", "4", "8", "8 sustained")


def cases(prompts: dict[str, list[list[int]]], batch1_prompts: int, max_tokens: int):
    """(domain, batch label, run): batch 1 = prompts one by one; batch 2 and 4 = the same
    prompts in closed batches of two and four; batch 8 = eight together (a closed batch, timed
    to its last token); batch 8 sustained = sixteen queued for eight slots, timed over the
    full-batch decode steps."""
    for domain, ps in prompts.items():
        yield domain, "1", lambda llm, ps=ps: [decode(llm, [p], max_tokens)
                                              for p in ps[:batch1_prompts]]
        for b in (2, 4):
            yield domain, str(b), lambda llm, ps=ps, b=b: [
                decode(llm, ps[i:i + b], max_tokens)
                for i in range(0, max(batch1_prompts, b) // b * b, b)]
        yield domain, "8", lambda llm, ps=ps: [decode(llm, ps[:8], max_tokens)]
        yield domain, "8 sustained", lambda llm, ps=ps: [
            decode_sustained(llm, ps[:16], max_tokens, 8)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--batch1-prompts", type=int, default=3)
    parser.add_argument("--warmup-tokens", type=int, default=None,
                        help="tokens per request in the untimed first pass (default: "
                             "--max-tokens; with 16, adaptive speculation was still trying "
                             "its arms in the first timed repetitions)")
    parser.add_argument("--prompt-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--num-speculative-tokens", type=int, default=3,
                        help="most drafts per sequence per step (k)")
    parser.add_argument("--tree-width", type=int, default=3,
                        help="continuations per draft tree in the -tree and +ngt configs")
    parser.add_argument("--no-adaptive", action="store_true",
                        help="always draft k (acceptance of k drafts, not what pays)")
    parser.add_argument("--tree-size", type=int, default=15,
                        help="most drafts per tree in the -tree and +ngt configs")
    parser.add_argument("--tree-min-prob", type=float, default=None,
                        help="the head's tree by probability in the -tree and +ngt configs "
                             "without a shape (default: the engine's)")
    parser.add_argument("--head", action="append", default=[], metavar="NAME=DIR",
                        type=extra_head,
                        help="also offer the head in DIR as configurations NAME and "
                             "NAME+ngt (two heads side by side in one run); give it "
                             "before --configs")
    parser.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS, type=config_name,
                        help=f"of {', '.join(CONFIGS)}; a tree one may name its own shape, "
                             "NAME@WIDTHxSIZE (prose-head+ngt@8x31)")
    parser.add_argument("--batches", nargs="+", default=["1", "8", "8 sustained"],
                        choices=BATCHES, help="which cases to run (default: 1, 8 and 8 "
                        "sustained)")
    parser.add_argument("--domains", nargs="+", default=["code", "prose"],
                        choices=["code", "prose"])
    parser.add_argument("--out", default="speculative-results.json")
    parser.add_argument("--pool", nargs="+", metavar="JSON",
                        help="run nothing: report the repetitions of these result files "
                             "together (same configurations and cases)")
    args = parser.parse_args()
    if args.pool:
        runs, run_log, first = pooled_runs(args.pool)
        for key in ("configs", "batches", "domains", "num_speculative_tokens"):
            setattr(args, key, first["args"][key])
        report(runs, [n for n in args.configs if (n, args.domains[0], args.batches[0]) in runs],
               args, run_log, first["speculators"])
        return 0
    llms = {n: llm for n in args.configs if (llm := build(n, args)) is not None}
    tok = next(iter(llms.values())).get_tokenizer()
    make = {"code": code_prompts, "prose": prose_prompts}
    wanted = max(16, args.batch1_prompts)  # batch 8 sustained queues 16
    prompts = {d: make[d](tok, wanted, args.prompt_tokens) for d in args.domains}
    for domain, ps in prompts.items():
        if len(ps) < wanted:
            parser.error(f"{domain}: {len(ps)} held-out prompts of {args.prompt_tokens} "
                         f"tokens, not {wanted}: lower --batch1-prompts")
    runs: dict[tuple, list[Run]] = {}
    run_log: list[dict] = []
    for rep in range(args.reps + 1):  # rep 0 warms every configuration up
        order = list(llms)
        random.Random(rep).shuffle(order)
        tokens = args.max_tokens if rep else (args.warmup_tokens or args.max_tokens)
        for domain, batch, measure in cases(prompts, args.batch1_prompts, tokens):
            if batch not in args.batches:
                continue
            for name in order:
                parts = measure(llms[name])
                run = Run(*(sum(getattr(p, f) for p in parts) for f in Run.__dataclass_fields__))
                run_log.append({"rep": rep, "domain": domain, "batch": batch, "config": name,
                                **vars(run)})
                if rep:
                    runs.setdefault((name, domain, batch), []).append(run)
                print(f"rep {rep} {domain:5s} batch {batch:11s} {name:13s} "
                      f"{run.tokens_per_s:6.1f} tok/s", flush=True)
    # which files each configuration drafted from (a preset trained here, or a shipped one)
    sources = {n: llm.engine.config.speculative.model for n, llm in llms.items()
               if llm.engine.config.speculative is not None}
    report(runs, list(llms), args, run_log, sources)
    return 0


def paired(runs: list[Run], base: list[Run], field: str) -> float:
    """Median over repetitions of this configuration's rate over "off"'s rate in the same
    repetition (run back to back): slow drifts in the machine's load cancel out."""
    return statistics.median(ratios(runs, base, field))


def ratios(runs: list[Run], base: list[Run], field: str) -> list[float]:
    return [getattr(r, field) / getattr(b, field) for r, b in zip(runs, base, strict=True)]


def pooled_runs(paths: list[str]) -> tuple[dict[tuple, list[Run]], list[dict], dict]:
    """The timed runs of earlier result files, as one run of their repetitions together
    (each file's repetitions stay paired with that file's "off")."""
    runs: dict[tuple, list[Run]] = {}
    log: list[dict] = []
    first = None
    for i, path in enumerate(paths):
        with open(path) as f:
            data = json.load(f)
        first = first or data
        for entry in data["runs"]:
            if entry["rep"]:
                run = Run(*(entry[f] for f in Run.__dataclass_fields__))
                runs.setdefault((entry["config"], entry["domain"], entry["batch"]),
                                []).append(run)
                log.append({**entry, "file": i})
    return runs, log, first


def report(runs: dict[tuple, list[Run]], names: list[str], args, run_log: list[dict],
           sources: dict[str, str | None]) -> None:
    rows = []
    for domain in args.domains:
        for batch in args.batches:
            base = runs[("off", domain, batch)]
            for name in names:
                rs = runs[(name, domain, batch)]
                steps = sum(r.verify_steps for r in rs)
                rows.append({"domain": domain, "batch": batch, "config": name,
                             "tokens_per_s": round(statistics.median(
                                 r.tokens_per_s for r in rs), 2),
                             "speedup": round(paired(rs, base, "tokens_per_s"), 3),
                             "speedup_ci": [round(x, 3) for x in median_interval(
                                 ratios(rs, base, "tokens_per_s"))],
                             "reps": len(rs),
                             "tokens_per_cpu_s": round(statistics.median(
                                 r.tokens_per_cpu_s for r in rs), 2),
                             "cpu_speedup": round(paired(rs, base, "tokens_per_cpu_s"), 3),
                             "mean_accepted": round(sum(r.accepted for r in rs) / steps, 2)
                             if steps else None,
                             "all": [round(r.tokens_per_s, 2) for r in rs]})
    print("\n| domain | batch | config | decode tok/s | vs off | 95% interval | tok per CPU-s "
          f"| vs off | accepted/verify (of {args.num_speculative_tokens}) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        acc = "-" if r["mean_accepted"] is None else f"{r['mean_accepted']:.2f}"
        lo, hi = r["speedup_ci"]
        print(f"| {r['domain']} | {r['batch']} | {r['config']} | {r['tokens_per_s']:.1f} | "
              f"{r['speedup']:.2f}x | {lo:.2f}-{hi:.2f} | {r['tokens_per_cpu_s']:.1f} | "
              f"{r['cpu_speedup']:.2f}x | {acc} |")
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "cpu": cpu_summary(), "prose": prose_source(),
                   "speculators": sources, "rows": rows, "runs": run_log}, f, indent=2)
    plot(rows, str(args.out).removesuffix(".json") + ".png")


def plot(rows: list[dict], path: str) -> None:
    """Speed-up over off per configuration, one panel per (domain, batch)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = sorted({(r["domain"], r["batch"]) for r in rows})
    fig, axes = plt.subplots(1, len(cases), figsize=(3.2 * len(cases), 3.4), sharey=True,
                             squeeze=False)
    for ax, (domain, batch) in zip(axes[0], cases, strict=True):
        case = [r for r in rows if (r["domain"], r["batch"]) == (domain, batch)]
        ax.bar([r["config"] for r in case], [r["speedup"] for r in case], color="tab:orange",
               yerr=[[r["speedup"] - r["speedup_ci"][0] for r in case],
                     [r["speedup_ci"][1] - r["speedup"] for r in case]], capsize=2)
        ax.axhline(1.0, color="gray", lw=0.8)
        if batch != "1":  # the floor for batch 8
            ax.axhline(0.95, color="tab:red", lw=0.6, ls="--")
        ax.set_title(f"{domain} prompts, batch {batch}")
        ax.tick_params(axis="x", rotation=45)
    axes[0][0].set_ylabel("decode tok/s vs off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    raise SystemExit(main())
