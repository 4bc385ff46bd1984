"""Per-call all-reduce latency between ranks on one machine: kiln's shared-memory all-reduce
versus torch.distributed's gloo over loopback.

Tensor parallelism calls an all-reduce twice per layer (60 times per decode step of the default
model), on the hidden state: 576 values per token. This times one call at batch 1 (1 x 576)
and batch 64 (64 x 576), fp32 and bf16, with `--world-size` ranks (default 2), each rank one
thread pinned to its own core where the machine has enough. Each figure is the median (and
90th percentile) over `--iters` calls of rank 0's per-call wall time, after `--warmup` calls;
the ranks start each case together. Prints a table; `--json PATH` writes the rows.

    python benchmarks/allreduce.py [--iters 5000] [--warmup 500] [--world-size 2]
        [--json results/allreduce.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kiln.distributed.shm_allreduce import ShmAllReduce

HIDDEN = 576  # the default model's hidden size
BATCHES = (1, 64)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class Row:
    backend: str  # "shm" or "gloo"
    batch: int
    dtype: str
    bytes: int
    median_us: float
    p90_us: float


def time_calls(call, iters: int, warmup: int) -> tuple[float, float]:
    """(median, 90th percentile) microseconds of one call."""
    for _ in range(warmup):
        call()
    times = []
    for _ in range(iters):
        start = time.perf_counter_ns()
        call()
        times.append((time.perf_counter_ns() - start) / 1e3)
    times.sort()
    return statistics.median(times), times[int(0.9 * (len(times) - 1))]


def measure(backend: str, reduce_, batch: int, dtype: str, args) -> Row:
    x = torch.zeros(batch, HIDDEN, dtype=DTYPES[dtype])  # zeros: sums stay finite
    dist.barrier()
    median, p90 = time_calls(lambda: reduce_(x), args.iters, args.warmup)
    return Row(backend, batch, dtype, x.numel() * x.element_size(), round(median, 2),
               round(p90, 2))


def run_rank(rank: int, args, store: str, name: str, out: str) -> None:
    torch.set_num_threads(1)
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) >= args.world_size:
        os.sched_setaffinity(0, {cores[rank]})
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=args.world_size)
    shm = ShmAllReduce(name, rank, args.world_size, max(BATCHES) * HIDDEN * 4)
    rows = []
    for batch in BATCHES:
        for dtype in DTYPES:
            rows.append(measure("shm", shm.all_reduce_, batch, dtype, args))
            rows.append(measure("gloo", dist.all_reduce, batch, dtype, args))
    shm.close()
    dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(json.dumps([asdict(row) for row in rows]))


def print_table(rows: list[Row], world_size: int) -> None:
    print(f"all-reduce latency per call, {world_size} ranks x 1 thread (microseconds)")
    print(f"{'batch':>5} {'dtype':>9} {'bytes':>7} {'shm med':>8} {'shm p90':>8} "
          f"{'gloo med':>9} {'gloo p90':>9} {'gloo/shm':>8}")
    by_case = {(r.batch, r.dtype, r.backend): r for r in rows}
    for batch in BATCHES:
        for dtype in DTYPES:
            shm, gloo = by_case[(batch, dtype, "shm")], by_case[(batch, dtype, "gloo")]
            print(f"{batch:>5} {dtype:>9} {shm.bytes:>7} {shm.median_us:>8.1f} "
                  f"{shm.p90_us:>8.1f} {gloo.median_us:>9.1f} {gloo.p90_us:>9.1f} "
                  f"{gloo.median_us / shm.median_us:>7.1f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=5000)
    parser.add_argument("--warmup", type=int, default=500)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        out = str(Path(scratch) / "rows.json")
        mp.spawn(run_rank, args=(args, str(Path(scratch) / "store"),
                                 f"bench-{uuid.uuid4().hex[:12]}", out),
                 nprocs=args.world_size, join=True)
        rows = [Row(**row) for row in json.loads(Path(out).read_text())]
    print_table(rows, args.world_size)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"world_size": args.world_size, "iters": args.iters,
                                         "rows": [asdict(row) for row in rows]}, indent=1))


if __name__ == "__main__":
    main()
