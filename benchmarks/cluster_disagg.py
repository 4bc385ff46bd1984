"""Disaggregated (1 prefill + 1 decode worker) vs aggregated (2 workers) serving.

Three random-prompt workloads on /v1/completions, Poisson arrivals:
  long-prefill   1024-token prompts, 16-token outputs (prefill-bound)
  long-decode      64-token prompts, 256-token outputs (decode-bound; below --disagg-min-tokens,
                 so the decode worker serves them alone)
  mixed           768-token prompts, 96-token outputs (prefills interrupt running decodes)
Each mode gets a fresh server per run; modes alternate; medians of --repeats.

    python benchmarks/cluster_disagg.py --repeats 2 --out benchmarks/results/cluster_disagg.json
"""

from __future__ import annotations

import argparse
from pathlib import Path

from cluster_common import bench, cluster, medians, metrics, save, summary

from kiln.bench.config import Endpoint, LoadConfig, WorkloadConfig, WorkloadKind

WORKLOADS = {  # name: (input_len, output_len, requests, rate)
    "long-prefill": (1024, 16, 20, 0.35),
    "long-decode": (64, 256, 20, 0.5),
    "mixed": (768, 96, 20, 0.3),
}
MODES = {
    "aggregated": (["--workers", "2"], 2),
    "disaggregated": (["--prefill-workers", "1", "--decode-workers", "1",
                       "--disagg-min-tokens", "256"], 2),
}


def run_one(mode: str, name: str, seed: int, out: Path) -> dict:
    input_len, output_len, n, rate = WORKLOADS[name]
    flags, workers = MODES[mode]
    workload = WorkloadConfig(kind=WorkloadKind.RANDOM, input_len=input_len,
                              output_len=output_len)
    with cluster(flags, f"{out.stem}-{name}-{mode}-{seed}", workers) as port:
        m = bench(port, workload, LoadConfig(num_requests=n, seed=seed, rate=rate),
                  Endpoint.COMPLETIONS)
        served = metrics(port)
    row = summary(m, {"mode": mode, "seed": seed,
                      "transfers_ok": served.get('kiln:kv_transfers_total{outcome="ok"}', 0),
                      "transfer_s": served.get("kiln:kv_transfer_seconds_total", 0)})
    print(f"{name:<13} {mode:<14} seed {seed}: TTFT p50 {row['ttft_p50_ms']:7.0f} ms  "
          f"TPOT p50 {row['tpot_p50_ms'] or 0:6.1f} ms  ITL p90 {row['itl_p90_ms'] or 0:6.1f} ms  "
          f"E2E p50 {row['e2e_p50_ms']:7.0f} ms  {row['output_tok_s']:6.1f} tok/s", flush=True)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS))
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    result = {}
    for name in args.workloads:
        runs: dict[str, list[dict]] = {m: [] for m in MODES}
        for rep in range(args.repeats):
            for mode in (MODES if rep % 2 == 0 else reversed(list(MODES))):
                runs[mode].append(run_one(mode, name, rep, args.out))
        result[name] = {"workload": dict(zip(("input_len", "output_len", "requests", "rate"),
                                             WORKLOADS[name], strict=True)),
                        "median": {m: medians(rows) for m, rows in runs.items()}, "runs": runs}
    save(args.out, result)


if __name__ == "__main__":
    main()
