"""A mixture of experts over 2 ranks on one machine: one process vs TP=2 (every expert split by
columns) vs EP=2 (whole experts per rank), and EP=2 with redundant copies of the hottest
experts placed from a load measured by the one-process run (issue 49, item 4).

The model is benchmarks/moe.py's random Qwen3-30B-A3B-shaped MoE (hidden 1,024, 64 experts,
top 8, expert width 384, 8 layers; made there if absent, under the same --dir). Each layout
runs in a fresh process, bf16 (or --format int8):

  one      1 process, T threads
  tp2      tensor_parallel_size 2, T/2 threads per rank: experts split by columns
  ep2      tensor_parallel_size 2 + enable_expert_parallel: 32 whole experts per rank
  ep2-rK   ep2 + num_redundant_experts K (--redundant, default 8) from one's measured load
  dp2      data_parallel_size 2 + enable_expert_parallel: attention whole per rank on its own
           requests (its own KV pool), 32 whole experts per rank, tokens exchanged around
           each sparse block (docs/moe.md, "Data-parallel attention"; not in the default
           --layouts: add it, e.g. --layouts one,ep2,dp2)
  dp2-cols data_parallel_size 2, every expert split by columns over the two ranks
  dp2-a2a  dp2 with all2all_backend alltoall: each rank routes its own tokens and sends each
           only to the rank computing its pairs, which sends the partial sums back
           (docs/moe.md, "All-to-all dispatch"; not in the default --layouts)

Rows per layout: batch1 (one 128-token prompt, 128 greedy tokens: prefill ms, decode tok/s,
decode time = the whole request's minus a 1-token request's) and batch32 (32 x 128/128 at
once: output tok/s), each with the measured expert load's imbalance (max / mean tokens per
expert, and per rank under EP; mean over layers) of the batch-32 run, the engine's KV blocks
(all ranks' pools: data-parallel ranks each hold a pool as large as one process's), and whether
the batch-32 greedy tokens equal one process's (bf16: rounding differs between layouts, so a
few may not). A batch-1 request runs on one data-parallel rank while the other only joins the
expert exchanges: dp2 is for batches. The dp2 layouts' batch rows also carry the bytes rank 0
put into the expert exchanges for the other rank per step of the batch run (counted:
`exchange_bytes_per_step`) and, computed from the shape, for a decode step of the whole batch
(`decode_step_bytes_model`: 16 tokens per rank, every token sent to the other rank under
alltoall, which at top 8 of 64 experts over 2 ranks misses about 1 token in 200).

usage: python benchmarks/moe_ep.py [--dir /tmp/kiln-moe-bench] [--threads 4] [--reps 3]
       [--format bf16|int8] [--redundant 8]
       [--layouts one,tp2,ep2,ep2-r,dp2,dp2-cols,dp2-a2a]
       [--out benchmarks/results/moe_ep.json]
       smoke check (toy model, few tokens): python benchmarks/moe_ep.py --tiny
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import moe as moe_bench  # noqa: E402  (benchmarks/moe.py: the model and its prompts)

LOAD_FILE = "expert_load.json"  # the one-process run's measured load, under the model dir


def layout_settings(layout: str, args, root: Path) -> dict:
    """LLM settings of one layout."""
    if layout == "one":
        return dict(num_threads=args.threads)
    if layout.startswith("dp2"):
        return dict(data_parallel_size=2, num_threads=max(1, args.threads // 2),
                    enable_expert_parallel=layout != "dp2-cols",
                    all2all_backend="alltoall" if layout == "dp2-a2a" else
                    "allgather_reducescatter")
    two = dict(tensor_parallel_size=2, num_threads=max(1, args.threads // 2))
    if layout == "tp2":
        return two
    two.update(enable_expert_parallel=True)
    if layout == "ep2-r":
        two.update(num_redundant_experts=args.redundant,
                   expert_load_file=str(root / LOAD_FILE))
    return two


def measure(layout: str, args, root: Path, shape) -> list[dict]:
    """One layout's rows (run in a fresh process: see main)."""
    from kiln import LLM, SamplingParams

    prompts = json.loads((root / "prompts.json").read_text())
    llm = LLM(str(root / "moe"), dtype="bfloat16", max_model_len=1024, kv_cache_memory=1 << 30,
              quantization=None if args.format == "bf16" else args.format,
              **layout_settings(layout, args, root))

    def run(batch: list[list[int]], new: int) -> tuple[float, list]:
        llm.engine.kv.set_prefix_caching(True)  # every run starts cold (every rank's pool)
        params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        return time.perf_counter() - start, [o.outputs[0].token_ids for o in outs]

    run(prompts[:4], 4)  # warm-up
    reps = args.reps
    total = statistics.median(run(prompts[:1], shape.new_tokens)[0] for _ in range(reps))
    prefill = statistics.median(run(prompts[:1], 1)[0] for _ in range(reps))
    before, sent = llm.expert_load(), exchange_counters(llm)
    many, tokens = run(prompts, shape.new_tokens)
    load, exchanged = llm.expert_load(), exchange_counters(llm)
    if layout == "one":
        load.save(root / LOAD_FILE)  # what ep2-r places its copies from
    (root / f"tokens-{layout}.json").write_text(json.dumps(tokens))
    llm.close()
    base = dict(layout=layout, format=args.format, threads=args.threads, reps=reps)
    return [dict(base, test="batch1", prefill_ms=round(prefill * 1e3, 1),
                 decode_tok_s=round((shape.new_tokens - 1) / (total - prefill), 1)),
            dict(base, test=f"batch{len(prompts)}",
                 out_tok_s=round(len(prompts) * shape.new_tokens / many, 1),
                 kv_blocks=llm.engine.kv.stats().num_blocks, **imbalance(before, load),
                 **exchange_row(layout, shape, sent, exchanged))]


def exchange_counters(llm) -> tuple[int, int] | None:
    """(steps, bytes sent to the other ranks) of rank 0's expert exchange (None: no DP)."""
    dp = llm.engine.runner.data_parallel
    return None if dp is None else (dp.exchange.steps, dp.exchange.sent_bytes)


def exchange_row(layout: str, shape, before, after) -> dict:
    if before is None:
        return {}
    steps, sent = after[0] - before[0], after[1] - before[1]
    return dict(exchange_bytes_per_step=round(sent / max(steps, 1)),
                decode_step_bytes_model=decode_step_bytes(layout, shape))


def decode_step_bytes(layout: str, shape, ranks: int = 2, bf16: int = 2) -> int:
    """Bytes a rank puts into the expert exchanges for the other rank in one decode step of
    the whole batch (`shape.batch` sequences, as many per rank), bf16, computed: the
    all-gather exchange publishes the step's [N, H] twice per sparse layer; the all-to-all
    sends a table row, its n tokens with their routing (k ids + k weights, 8k bytes) and the
    n partial sums it computed for the other rank."""
    n, h, k, e = shape.batch // ranks, shape.hidden, shape.top_k, shape.experts
    if layout != "dp2-a2a":
        per_layer = 2 * shape.batch * h * bf16
    else:
        per_layer = 4 * (2 * ranks + e) + n * (h * bf16 + 8 * k) + n * h * bf16
    return per_layer * shape.layers


def imbalance(before, after) -> dict:
    """Mean over layers of the batch run's max / mean tokens per expert (and per rank)."""
    from kiln.models.layers.expert_parallel import ExpertLoad

    ranks = None if after.rank_tokens is None else after.rank_tokens - before.rank_tokens
    run = ExpertLoad(after.layers, after.tokens - before.tokens, ranks)
    row = dict(expert_imbalance=round(run.expert_imbalance().mean().item(), 3))
    if ranks is not None:
        row["rank_imbalance"] = round(run.rank_imbalance().mean().item(), 3)
    return row


def run_layout(layout: str, args) -> list[dict]:
    cmd = [sys.executable, __file__, "--measure", layout, "--dir", args.dir, "--format",
           args.format, "--reps", str(args.reps), "--threads", str(args.threads),
           "--redundant", str(args.redundant)] + (["--tiny"] if args.tiny else [])
    env = os.environ | moe_bench.KILN_BIND | {"PYTHONPATH": str(ROOT / "src")}
    if layout != "one":  # every rank would bind from the same first core
        env = {k: v for k, v in env.items() if k not in moe_bench.KILN_BIND}
    print(f"running {layout} ...", flush=True)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not rows:
        print(f"  failed: {proc.stderr.strip()[-800:]}")
    return rows


def same_tokens(root: Path, layouts: list[str]) -> list[dict]:
    """Per layout: how many batch sequences' greedy tokens equal one process's."""
    ref_file = root / "tokens-one.json"
    if not ref_file.exists():
        return []
    ref = json.loads(ref_file.read_text())
    rows = []
    for layout in layouts:
        path = root / f"tokens-{layout}.json"
        if layout != "one" and path.exists():
            got = json.loads(path.read_text())
            rows.append(dict(test="same_tokens_as_one", layout=layout,
                             sequences=sum(a == b for a, b in zip(ref, got, strict=True)),
                             of=len(ref)))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default="/tmp/kiln-moe-bench", help="checkpoints (made if absent)")
    p.add_argument("--threads", type=int, default=4, help="cores in all (T/2 per rank)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--format", default="bf16", help="bf16 or a kiln weight format (int8)")
    p.add_argument("--redundant", type=int, default=8, help="ep2-r's num_redundant_experts")
    p.add_argument("--layouts", default="one,tp2,ep2,ep2-r")
    p.add_argument("--tiny", action="store_true", help="a toy shape, to check the script")
    p.add_argument("--out", help="write every row as JSON here")
    p.add_argument("--measure", help=argparse.SUPPRESS)  # internal: one layout, fresh process
    args = p.parse_args()
    shape = moe_bench.TINY if args.tiny else moe_bench.FULL
    root = Path(args.dir) / ("tiny" if args.tiny else "full")
    if args.measure:
        for row in measure(args.measure, args, root, shape):
            print(json.dumps(row), flush=True)
        return
    moe_bench.make_checkpoints(root, shape)
    layouts = args.layouts.split(",")
    if "ep2-r" in layouts and "one" not in layouts and not (root / LOAD_FILE).exists():
        sys.exit("ep2-r places copies from the one-process run's load: include layout 'one'")
    rows = [row for layout in layouts for row in run_layout(layout, args)]
    rows += same_tokens(root, layouts)
    for row in rows:
        print(json.dumps(row))
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
