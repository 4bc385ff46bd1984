"""The short-query attention kernel on a verify step's query at batch 1: 1 and 2 threads.

  python benchmarks/tree_attention.py [--context 150] [--out results.json]

A verify step at batch 1 attends one sequence's query of 1 + drafts tokens (a draft tree's
bits, as the engine passes them) over its context, in every layer: this times
`torch.ops.kiln.paged_attention` for the default model's shapes (9 query heads, 3 kv heads,
head dim 64, bf16 cache, 16-token blocks) over 30 layers, per query length, with 1 thread and
with 2. With 3 kv heads on 2 threads a job per kv head leaves one thread two heads and the
other one; the kernel splits such a query's tokens between jobs (`paged_attention` in
kiln/kernels/cpu/paged_attention.cpp), and the 2-thread time over the 1-thread time says how well
the two threads share it. Median of 60 timings of 30 calls each.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from kiln.bench.result import cpu_summary
from kiln.kernels import cpu as cpu_kernels

LAYERS, HQ, HKV, D, BLOCK = 30, 9, 3, 64, 16


def tree_bits(n: int, seed: int = 0) -> torch.Tensor:
    """A random tree of n query tokens (the root first): each token's ancestors and itself."""
    gen, bits = torch.Generator().manual_seed(seed), [1]
    for i in range(1, n):
        bits.append(bits[int(torch.randint(i, (1,), generator=gen))] | 1 << i)
    return torch.tensor(bits)


def time_query(n: int, context: int, threads: int, reps: int = 60) -> float:
    torch.set_num_threads(threads)
    blocks = -(-(context + n) // BLOCK)
    k_cache = torch.randn(blocks * 3 * BLOCK, HKV, D, dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    table = (torch.arange(blocks) * 3).view(1, -1)  # scattered blocks, as a pool hands out
    q = torch.randn(n, HQ, D, dtype=torch.bfloat16)
    out = torch.empty(n, HQ * D, dtype=torch.bfloat16)
    start, lens, ctx = torch.tensor([0]), torch.tensor([n]), torch.tensor([context])
    tree = tree_bits(n) if n > 1 else None
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(LAYERS):
            torch.ops.kiln.paged_attention(out, q, k_cache, v_cache, table, start, lens, ctx,
                                           BLOCK, D ** -0.5, tree)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=150)
    parser.add_argument("--queries", type=int, nargs="+", default=[1, 4, 13, 21, 32])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not cpu_kernels.load():
        parser.error("kiln's CPU kernels did not build here")
    rows = []
    print("| query tokens | 1 thread (ms, 30 layers) | 2 threads | 1 thread / 2 threads |")
    print("|---|---|---|---|")
    for n in args.queries:
        one, two = time_query(n, args.context, 1), time_query(n, args.context, 2)
        rows.append({"query": n, "one_thread_ms": round(one, 3), "two_threads_ms": round(two, 3),
                     "scaling": round(one / two, 2)})
        print(f"| {n} | {one:.2f} | {two:.2f} | {one / two:.2f}x |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "cpu": cpu_summary(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
