"""The data-parallel expert exchange alone: allgather_reducescatter vs alltoall, 2 ranks.

Two rank processes (one thread each) on this machine join a rank group (shared-memory
all-reduce and all-to-all, or --all-reduce gloo) and time one sparse block's exchange with
no expert math, at benchmarks/moe.py's Qwen3-30B-A3B-scaled shape (hidden 1,024 bf16, 64
experts, top 8; expert e on rank e mod 2) for n tokens per rank, random routing:

  allgather_reducescatter  TokenExchange.gather + reduce_own: two all-reduces of [2n, H]
  alltoall                 ExpertDispatch: the plan, the counts table's all-reduce, the
                           dispatch and the combine (the partial sums: the received rows)

Rows: n, backend, median and p90 microseconds per block (over --reps blocks after a
warm-up), and the bytes rank 0 put into the exchange for rank 1 per block. Both ranks share
the machine's cores with whatever else runs: on a loaded machine the figures are noisy.

usage: python benchmarks/moe_exchange.py [--tokens 1,4,16,64,256] [--reps 200]
       [--all-reduce shm|gloo] [--out benchmarks/results/moe_exchange.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
HIDDEN, EXPERTS, TOP_K, RANKS = 1024, 64, 8, 2


def time_blocks(block, reps: int) -> tuple[float, float]:
    """(median, p90) microseconds of `block()` over reps calls, after 10 warm-up calls."""
    for _ in range(10):
        block()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        block()
        times.append((time.perf_counter() - start) * 1e6)
    times.sort()
    return statistics.median(times), times[int(0.9 * (len(times) - 1))]


def measure(exchange, n: int, generator: torch.Generator, reps: int) -> list[dict]:
    """Both backends' rows for n tokens per rank (every rank calls it alike)."""
    from kiln.distributed.expert_dispatch import plan_dispatch

    x = torch.randn(n, HIDDEN, generator=generator).bfloat16()
    weights, experts = torch.rand(n, EXPERTS, generator=generator).topk(TOP_K, dim=-1)
    owners, dispatch = experts % RANKS, exchange.dispatch
    exchange.begin_step([n] * RANKS)

    def allgather():
        exchange.reduce_own(exchange.gather(x).clone())

    def alltoall():
        plan = plan_dispatch(owners, experts, RANKS, EXPERTS)
        counts = dispatch.exchange_counts(plan)
        got = dispatch.dispatch(x, experts, weights, owners, plan, counts)
        dispatch.combine(got.rows, plan, counts, n)

    rows = []
    for name, block in (("allgather_reducescatter", allgather), ("alltoall", alltoall)):
        sent = exchange.sent_bytes
        block()
        sent = exchange.sent_bytes - sent
        median, p90 = time_blocks(block, reps)
        rows.append(dict(tokens_per_rank=n, backend=name, median_us=round(median, 1),
                         p90_us=round(p90, 1), bytes_to_other_rank=sent))
    return rows


def rank_main(rank: int, port: int, args, queue) -> None:
    sys.path.insert(0, str(ROOT / "src"))
    from kiln.distributed.dp_attention import TokenExchange
    from kiln.distributed.launch import join_groups, join_store

    torch.set_num_threads(1)
    store = join_store(port, RANKS, 60)
    group = join_groups(store, rank, RANKS, 60, args.all_reduce, name=f"moe-exchange-{port}")
    exchange = TokenExchange(group.comm, all_to_all=True)
    generator = torch.Generator().manual_seed(rank)
    for n in args.tokens:
        for row in measure(exchange, n, generator, args.reps):
            if rank == 0:
                queue.put(dict(row, all_reduce=args.all_reduce))
    group.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", default="1,4,16,64,256", help="tokens per rank, comma-separated")
    p.add_argument("--reps", type=int, default=200)
    p.add_argument("--all-reduce", default="shm", choices=("shm", "gloo"))
    p.add_argument("--out", help="write the rows as JSON here")
    args = p.parse_args()
    args.tokens = [int(n) for n in args.tokens.split(",")]
    sys.path.insert(0, str(ROOT / "src"))
    from kiln.distributed.launch import open_store

    store = open_store(RANKS, 60)
    queue = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(rank_main, args=(store.port, args, queue), nprocs=RANKS,
                       start_method="spawn")
    rows = []
    while not queue.empty():
        rows.append(queue.get())
    for row in rows:
        print(json.dumps(row))
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
