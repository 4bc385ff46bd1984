"""The model size above which tensor parallelism beats one process on the same cores, computed
from recorded measurements (it times nothing).

Batch-b decode streams every weight once per step; per layer (kiln.bench.sim_tp):

    one process on C cores:  12 h^2 d / (C bw e_one)
    TP = T on the same C:    12 h^2 d / (C bw e_rank) + 2 all_reduce(b h d, T)

Inputs, all recorded in benchmarks/results/:
  - bw, one core's share of the read bandwidth: ceiling.json (best GB/s over its threads);
  - e_one and e_rank, the fraction of it a decode reaches: tp_decode.json's batch-1 decode of
    the random ~1.1B Llama at TP = 1 (one process, all threads) and TP = 2 over shm (one
    thread per rank, less its modeled all-reduces), over the bytes a token streams;
  - the all-reduce per call: allreduce.json (shm on one machine, gloo across machines),
    the 2-rank line scaled to T ranks (kiln.bench.sim_tp.AllReduceCost).

TP wins where a rank streams faster per core than one process's threads (e_rank > e_one) by
more than its all-reduces cost; the crossover hidden size solves that per layer, and is named
as a Llama-shaped model's parameter count (h / 128 layers). Where the measured rates give no
crossover, the rows for a one-process shortfall (one process reaching 95/90/80% of a rank's
rate, and the default model's measured 2-thread fraction of the ceiling) say how large a
model must be on a machine where one process's threads fall that short (more cores, more
memory channels or sockets than one process's threads stream from well).

usage: python benchmarks/tp_crossover.py [--results benchmarks/results]
       [--out benchmarks/results/tp_crossover.json]   (writes the .png beside it)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
from kiln.bench.sim_tp import (  # noqa: E402
    AllReduceCost,
    DecodeRates,
    crossover_hidden,
    family_params,
    fit_all_reduce,
    layer_step_s,
)

RANKS = (2, 4, 8)
BATCHES = (1, 64)
DTYPE_BYTES = 2  # bf16
# the random ~1.1B Llama of benchmarks/tp_decode.py (TinyLlama's shape; its tiny tokenizer's
# 512-token vocabulary: the LM head streams next to nothing)
ONE_B = dict(hidden=2048, intermediate=5632, layers=22, heads=32, kv_heads=4, vocab=512)
SHORTFALLS = (0.95, 0.9, 0.8)


def streamed_bytes(m: dict) -> float:
    """The bytes one decoded token reads: every layer's weights and the LM head."""
    head_dim = m["hidden"] // m["heads"]
    attention = m["hidden"] * head_dim * (2 * m["heads"] + 2 * m["kv_heads"])
    mlp = 3 * m["hidden"] * m["intermediate"]
    return DTYPE_BYTES * (m["layers"] * (attention + mlp) + m["vocab"] * m["hidden"])


def measured_rates(results: Path, shm: AllReduceCost) -> tuple[DecodeRates, dict]:
    ceiling = json.loads((results / "ceiling.json").read_text())
    core_bw = ceiling["bandwidth_gb_s"]["best"] * 1e9 / ceiling["threads"]
    tp = json.loads((results / "tp_decode.json").read_text())
    runs = tp["models"]["random-1.1b"]["runs"]
    one = next(r for r in runs if r["tp"] == 1)
    two = next(r for r in runs if r["tp"] == 2 and r["all_reduce"] == "shm")
    weights = streamed_bytes(ONE_B)
    threads = one["threads_per_rank"]
    e_one = weights * one["batch1_decode_tok_s"] / (threads * core_bw)
    comm_s = 2 * ONE_B["layers"] * shm.call_s(ONE_B["hidden"] * DTYPE_BYTES, 2)
    stream_s = 1 / two["batch1_decode_tok_s"] - comm_s
    e_rank = weights / 2 / stream_s / (two["threads_per_rank"] * core_bw)
    inputs = {"core_bandwidth_gb_s": core_bw / 1e9, "ceiling_threads": ceiling["threads"],
              "streamed_gb_per_token_1b": weights / 1e9,
              "tp1_batch1_tok_s": one["batch1_decode_tok_s"],
              "tp2_shm_batch1_tok_s": two["batch1_decode_tok_s"],
              "tp2_modeled_comm_ms": comm_s * 1e3,
              "measured_tp2_over_tp1": two["batch1_decode_tok_s"] / one["batch1_decode_tok_s"]}
    return DecodeRates(core_bw, e_one, e_rank), inputs


def scenarios(measured: DecodeRates, results: Path) -> dict[str, DecodeRates]:
    """The measured rates, then one process falling short of a rank's rate by each ratio."""
    offline = json.loads((results / "offline.json").read_text())
    small = offline["notes"]["decode_fraction_of_ceiling"]
    out = {"measured": measured}
    for ratio in SHORTFALLS:
        out[f"one process at {ratio:.0%} of a rank"] = DecodeRates(
            measured.core_bandwidth_bps, measured.rank_efficiency * ratio,
            measured.rank_efficiency)
    out[f"one process at the default model's {small:.0%} of the ceiling"] = DecodeRates(
        measured.core_bandwidth_bps, small, measured.rank_efficiency)
    return out


def crossover_rows(rates: dict[str, DecodeRates], costs: dict[str, AllReduceCost]) -> list:
    rows = []
    for name, r in rates.items():
        for backend, cost in costs.items():
            for ranks in RANKS:
                for batch in BATCHES:
                    h = crossover_hidden(ranks, r, cost, batch, DTYPE_BYTES)
                    rows.append({"scenario": name, "all_reduce": backend, "tp": ranks,
                                 "batch": batch, "e_one": r.one_process_efficiency,
                                 "e_rank": r.rank_efficiency, "crossover_hidden": h,
                                 "crossover_params": None if h is None else family_params(h)})
    return rows


def speedup_curve(r: DecodeRates, cost: AllReduceCost, ranks: int, batch: int) -> list:
    """(params, one process's layer time / TP's) over hidden sizes 256..32768."""
    points = []
    for h in [256 * 2 ** (k / 4) for k in range(29)]:
        one = layer_step_s(h, 1, r, cost, batch, DTYPE_BYTES, cores=ranks)
        points.append((family_params(h), one / layer_step_s(h, ranks, r, cost, batch,
                                                            DTYPE_BYTES)))
    return points


def plot(rates: dict[str, DecodeRates], shm: AllReduceCost, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(RANKS), figsize=(5 * len(RANKS), 4), sharey=True)
    for ax, ranks in zip(axes, RANKS, strict=True):
        for name, r in rates.items():
            xs, ys = zip(*speedup_curve(r, shm, ranks, 1), strict=True)
            ax.plot(xs, ys, label=name)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set(xscale="log", xlabel="parameters (Llama-shaped, h/128 layers)",
               title=f"TP={ranks} vs one process, {ranks} cores, batch 1, shm")
    axes[0].set_ylabel("speedup of TP (one process's step / TP's)")
    axes[-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--out", type=Path,
                        default=ROOT / "benchmarks" / "results" / "tp_crossover.json")
    args = parser.parse_args()
    costs = {b: fit_all_reduce(args.results / "allreduce.json", b) for b in ("shm", "gloo")}
    measured, inputs = measured_rates(args.results, costs["shm"])
    rates = scenarios(measured, args.results)
    rows = crossover_rows(rates, costs)
    for row in rows:
        if row["all_reduce"] == "shm" and row["batch"] == 1:
            params = row["crossover_params"]
            print(f"{row['scenario']:<50} TP={row['tp']}: "
                  + ("never" if params is None else f"above {params / 1e6:,.0f}M parameters "
                     f"(hidden {row['crossover_hidden']:,.0f})"))
    args.out.write_text(json.dumps({"inputs": inputs, "all_reduce": {
        b: vars(c) for b, c in costs.items()}, "rates": {n: vars(r) for n, r in rates.items()},
        "rows": rows}, indent=1) + "\n")
    plot(rates, costs["shm"], args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
