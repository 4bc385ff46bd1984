"""What a verify step costs after its forward, by rows, with and without the verify shortlist.

  python benchmarks/experiments/verify_shortlist.py [--configs prose-head+ngt@6x20:0.01] [--prompts 12] \
      [--out results.json]

After a step's forward pass the runner turns the final hidden states into tokens: the LM head
over the sampling rows, the sampler and the verification walk, and for a tree the move of the
accepted path's KV. With `SpeculativeConfig.verify_shortlist` (kiln.speculative.shortlist) a greedy
verify step of 9 rows or more scores the whole vocabulary only on the rows the walk visits.
This decodes the same held-out prompts (`benchmarks/speculative.py`'s) with each
configuration twice in one process, shortlist on and off (`NAME` and `NAME/full`),
alternating per prompt, k = 3 forced, and reports the median of that post-forward time per
number of query rows (the step's tokens: a tree's root and drafts), with the steps counted.
Prefill steps are left out. A chart (`--out` with .png) draws both against the rows.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/speculative.py
from speculative import FULL, build, decode  # noqa: E402

from kiln.bench.result import cpu_summary
from kiln.speculative.training.data import code_prompts, prose_prompts


def instrument(llm, times: dict[int, list[float]]) -> None:
    """Record each decode step's time from the end of its forward to the end of execute,
    keyed by the step's query rows."""
    runner, state = llm.engine.runner, {}
    forward, execute = runner.forward, runner.execute

    def timed_forward(sched):
        out = forward(sched)
        state["rows"], state["t"] = sum(len(i.token_ids) for i in sched.scheduled), time.perf_counter()
        return out

    def timed_execute(sched):
        out = execute(sched)
        if not any(item.start_pos < len(item.prompt_token_ids) for item in sched.scheduled):
            times[state["rows"]].append(time.perf_counter() - state["t"])
        return out

    runner.forward, runner.execute = timed_forward, timed_execute


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+",
                        default=["prose-head+ngt@6x20:0.01", "prose-head+ngt@3x12"])
    parser.add_argument("--domain", choices=["prose", "code"], default="prose")
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    settings = argparse.Namespace(threads=args.threads, no_adaptive=True,
                                  num_speculative_tokens=3, tree_width=3, tree_size=12,
                                  tree_min_prob=None)
    names = [n for c in args.configs for n in (c, c + FULL)]
    llms = {n: build(n, settings) for n in names}
    if any(llm is None for llm in llms.values()):
        parser.error("a configuration's speculator is missing")
    make = {"code": code_prompts, "prose": prose_prompts}[args.domain]
    prompts = make(next(iter(llms.values())).get_tokenizer(), args.prompts + 1, 96)
    times = {n: collections.defaultdict(list) for n in names}
    for name, llm in llms.items():
        decode(llm, [prompts[0]], args.max_tokens)  # warm-up, untimed
        instrument(llm, times[name])
    for prompt in prompts[1:]:
        for llm in llms.values():
            decode(llm, [prompt], args.max_tokens)
    rows = []
    for config in args.configs:
        on, off = times[config], times[config + FULL]
        print(f"{config}: rows | after the forward, shortlist (ms) | without (ms) | steps")
        for n in sorted(set(on) & set(off)):
            row = {"config": config, "rows": n, "shortlist_ms": statistics.median(on[n]) * 1e3,
                   "full_ms": statistics.median(off[n]) * 1e3, "steps": len(on[n])}
            rows.append(row)
            print(f"  {n} | {row['shortlist_ms']:.2f} | {row['full_ms']:.2f} | {row['steps']}")
    if args.out:
        result = {"args": vars(args), "cpu": cpu_summary(), "rows": rows}
        Path(args.out).write_text(json.dumps(result, indent=1))
        plot(rows, str(Path(args.out).with_suffix(".png")))
    return 0


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for config in dict.fromkeys(r["config"] for r in rows):
        mine = [r for r in rows if r["config"] == config and r["steps"] >= 3]
        xs = [r["rows"] for r in mine]
        ax.plot(xs, [r["full_ms"] for r in mine], "-o", ms=3, label=f"{config}, every row")
        ax.plot(xs, [r["shortlist_ms"] for r in mine], "-s", ms=3,
                label=f"{config}, shortlist")
    ax.set_xlabel("query rows in the step (root + drafts)")
    ax.set_ylabel("ms after the forward (median)")
    ax.set_title("A verify step's LM head, sampler and walk, batch 1")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
