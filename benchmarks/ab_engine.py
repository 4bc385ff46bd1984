"""The same engine workload on several source trees (commits), alternated, one process per run.

Answers "did this change move the engine's speed or its output?": batch-1 decode (128-token
prompt, 128 greedy tokens, median of 5, prefill subtracted) and 64 x 128/128 throughput on the
default model in bf16, 2 threads pinned as `kiln serve` pins a worker, plus a digest of the 64
greedy outputs (equal digests: the same tokens). Each tree is a checkout's `src` directory
(`git worktree add --detach DIR COMMIT`), imported through PYTHONPATH.

usage: python benchmarks/ab_engine.py PROMPTS.json NAME=SRC [NAME=SRC ...] [--rounds 3]
       [--out results.json]      (PROMPTS.json: benchmarks/peers/make_prompts.py's output)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

ONE_RUN = r'''
import hashlib, json, os, statistics, sys, time
from kiln import LLM, SamplingParams
prompts = json.load(open(sys.argv[1]))
llm = LLM(os.path.expanduser("~/.cache/kiln/models/SmolLM2-135M-Instruct"), dtype="bfloat16",
          max_model_len=2048, num_threads=2, kv_cache_memory=1 << 30)
def run(ps, new):
    llm.engine.kv.pool.reset_prefix_cache()
    sp = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], sp, use_tqdm=False)
    return time.perf_counter() - t, outs
run(prompts[:8], 16)
whole = statistics.median(run(prompts[:1], 128)[0] for _ in range(5))
prefill = statistics.median(run(prompts[:1], 1)[0] for _ in range(5))
t64, outs = run(prompts[:64], 128)
tokens = json.dumps([o.outputs[0].token_ids for o in outs]).encode()
print(json.dumps({"decode_tok_s": 127 / (whole - prefill), "offline64_tok_s": 64 * 128 / t64,
                  "tokens_sha": hashlib.sha256(tokens).hexdigest()[:16]}))
'''


def one_run(src: str, prompts: str) -> dict:
    env = dict(os.environ, PYTHONPATH=src, OMP_PROC_BIND="close", OMP_PLACES="cores")
    out = subprocess.run([sys.executable, "-c", ONE_RUN, prompts], env=env, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("prompts")
    ap.add_argument("trees", nargs="+", help="NAME=SRC")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out")
    args = ap.parse_args()
    trees = dict(t.split("=", 1) for t in args.trees)
    runs: dict[str, list[dict]] = {name: [] for name in trees}
    for _ in range(args.rounds):
        for name, src in trees.items():
            runs[name].append(one_run(src, args.prompts))
            print(name, runs[name][-1], flush=True)
    summary = {name: {"decode_tok_s": statistics.median(r["decode_tok_s"] for r in rs),
                      "offline64_tok_s": statistics.median(r["offline64_tok_s"] for r in rs),
                      "tokens_sha": sorted({r["tokens_sha"] for r in rs}), "runs": rs}
               for name, rs in runs.items()}
    for name, s in summary.items():
        print(f"{name:>8}: decode {s['decode_tok_s']:.1f} tok/s, 64 x 128/128 "
              f"{s['offline64_tok_s']:.1f} tok/s, tokens {','.join(s['tokens_sha'])}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=2)


if __name__ == "__main__":
    main()
