"""KV-aware vs round-robin routing on a multi-turn coding workload, 2-4 real workers.

Workload (kiln bench multi-turn): S coding sessions share a 256-token system prompt; each opens
with a 512-token task and code message, then T-1 short follow-ups (64 tokens), 32-token replies;
the conversation so far is resent every turn, so a turn's prompt is the previous turn's prompt
plus reply plus the new message. Sessions start at a Poisson rate. Each router gets a fresh
server (cold caches); routers alternate within each repeat; medians of --repeats.

    python benchmarks/cluster_routing.py --workers 2 --repeats 3 \\
        --out benchmarks/results/cluster_routing_2w.json
"""

from __future__ import annotations

import argparse
from pathlib import Path

from cluster_common import bench, cluster, medians, metrics, save, summary

from kiln.bench.config import LoadConfig, WorkloadConfig, WorkloadKind


def workload(args: argparse.Namespace) -> WorkloadConfig:
    return WorkloadConfig(kind=WorkloadKind.MULTI_TURN, sessions=args.sessions,
                          turns=args.turns, system_len=256, first_input_len=512, input_len=64,
                          output_len=32)


def run_one(router: str, args: argparse.Namespace, seed: int, log: str) -> dict:
    flags = ["--workers", str(args.workers), "--router", router]
    with cluster(flags, log, args.workers) as port:
        load = LoadConfig(num_requests=args.sessions * args.turns, seed=seed, rate=args.rate)
        m = bench(port, workload(args), load)
        served = {k: v for k, v in metrics(port).items() if "router_decisions" in k}
    row = summary(m, {"router": router, "seed": seed})
    row["decisions"] = served
    print(f"{router:<12} seed {seed}: cached {row['cached_token_ratio']:.3f}  TTFT p50 "
          f"{row['ttft_p50_ms']:.0f} ms  p90 {row['ttft_p90_ms']:.0f} ms  "
          f"({row['duration_s']:.0f} s)", flush=True)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--routers", nargs="+", default=["kv-aware", "round-robin"])
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--rate", type=float, default=0.5, help="sessions started per second")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    runs: dict[str, list[dict]] = {r: [] for r in args.routers}
    for rep in range(args.repeats):
        order = args.routers if rep % 2 == 0 else list(reversed(args.routers))
        for router in order:
            log = f"{args.out.stem}-{router}-{rep}"
            runs[router].append(run_one(router, args, rep, log))
    result = {"workers": args.workers, "workload": vars(workload(args)) | {"kind": "multi-turn"},
              "rate": args.rate, "repeats": args.repeats,
              "median": {r: medians(rows) for r, rows in runs.items()}, "runs": runs}
    save(args.out, result)
    kv, rr = result["median"].get("kv-aware"), result["median"].get("round-robin")
    if kv and rr:
        print(f"cached-token ratio x{kv['cached_token_ratio'] / rr['cached_token_ratio']:.2f}, "
              f"TTFT p50 {rr['ttft_p50_ms'] / kv['ttft_p50_ms']:.2f}x lower, "
              f"p90 {rr['ttft_p90_ms'] / kv['ttft_p90_ms']:.2f}x lower")


if __name__ == "__main__":
    main()
