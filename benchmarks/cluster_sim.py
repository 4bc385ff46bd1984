"""The simulator: routing policies at 16 and 64 workers, and its error against a real run.

1. Scale: `kiln bench sim` on the multi-turn coding workload with 25 sessions per worker
   (8 turns each) started at 0.15 sessions/s per worker -- 3,200 and 12,800 requests -- for
   kv-aware, least-load and round-robin.
2. Check: the 2-worker multi-turn run of cluster_routing.py replayed in the simulator (same
   workload, seeds and arrival rate, cost model fitted by `kiln bench sim-fit`): simulated vs
   measured medians, relative error.

    kiln bench sim-fit --threads 1 --out benchmarks/results/cluster_cost_model.json
    python benchmarks/cluster_sim.py --cost-model benchmarks/results/cluster_cost_model.json \\
        --real benchmarks/results/cluster_routing_2w.json --out benchmarks/results/cluster_sim.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from cluster_common import save

from kiln.bench.config import LoadConfig, WorkloadConfig, WorkloadKind
from kiln.bench.sim import SimConfig, simulate, summary_row
from kiln.bench.sim_cost import CostModel

POLICIES = ["kv-aware", "least-load", "round-robin"]
COMPARED = ["cached_token_ratio", "ttft_p50_ms", "ttft_p90_ms", "e2e_p50_ms", "duration_s"]


def multi_turn(sessions: int, turns: int) -> WorkloadConfig:
    return WorkloadConfig(kind=WorkloadKind.MULTI_TURN, sessions=sessions, turns=turns,
                          system_len=256, first_input_len=512, input_len=64, output_len=32)


def scale(cost: CostModel, workers: list[int]) -> list[dict]:
    rows = []
    for n in workers:
        workload = multi_turn(25 * n, 8)
        load = LoadConfig(num_requests=25 * n * 8, rate=0.15 * n, seed=0)
        for policy in POLICIES:
            row = summary_row(simulate(SimConfig(num_workers=n, router=policy), cost,
                                       workload, load))
            print(f"{n} workers {policy:<12} cached {row['cached_token_ratio']:.3f}  "
                  f"TTFT p50 {row['ttft_p50_ms']:.0f} ms  p90 {row['ttft_p90_ms']:.0f} ms  "
                  f"({row['requests']} requests simulated in {row['sim_wall_s']:.1f} s)",
                  flush=True)
            rows.append(row)
    return rows


def check(cost: CostModel, real_path: Path) -> dict:
    real = json.loads(real_path.read_text())
    w = real["workload"]
    workload = multi_turn(w["sessions"], w["turns"])
    out = {}
    for policy, runs in real["runs"].items():
        sims = [summary_row(simulate(SimConfig(num_workers=real["workers"], router=policy),
                                     cost, workload,
                                     LoadConfig(num_requests=w["sessions"] * w["turns"],
                                                rate=real["rate"], seed=run["seed"])))
                for run in runs]
        sim = {k: statistics.median(s[k] for s in sims) for k in COMPARED}
        measured = real["median"][policy]
        out[policy] = {k: {"real": measured[k], "sim": sim[k],
                           "error": (sim[k] - measured[k]) / measured[k]} for k in COMPARED}
        print(f"{policy}: " + ", ".join(f"{k} real {v['real']:.3g} sim {v['sim']:.3g} "
                                        f"({v['error']:+.0%})" for k, v in out[policy].items()))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cost-model", type=Path, required=True)
    p.add_argument("--real", type=Path, help="cluster_routing.py result at 2 workers")
    p.add_argument("--workers", type=int, nargs="+", default=[16, 64])
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    cost = CostModel.load(args.cost_model)
    result = {"cost_model": cost.__dict__, "scale": scale(cost, args.workers)}
    if args.real:
        result["check"] = check(cost, args.real)
    save(args.out, result)


if __name__ == "__main__":
    main()
