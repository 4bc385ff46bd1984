"""bf16 weights on a CPU without bf16 instructions: kiln's kernel vs torch's bf16 matmul vs fp32.

Two parts, one run, written to one JSON file and drawn to one PNG:

* layers: y = x @ W^T for the default model's 576x1536 and 1536x576 shapes at several token
  counts, each candidate cycling over `--copies` distinct weights so they come from memory as
  in a decode step: torch's bf16 `F.linear`, `torch.ops.kiln.bf16_gemm`, widening W to fp32
  then fp32 GEMM, and an fp32 `F.linear` on fp32 weights (twice the bytes);
* engine: the default model's decode tokens/s at batch 1 and 8 (48 greedy tokens, EOS
  ignored) and a 512-token prefill (TTFT), for bf16 with `linear_backend="torch"` (what kiln
  ran before on such CPUs), bf16 with `"bf16-fp32"` (kiln's kernel; the default there), and
  fp32 weights — medians of `--reps` repetitions, the configurations interleaved.

    python benchmarks/cpu_bf16.py [--reps 5] [--threads 2] [--out FILE.json] [--plot FILE.png]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.progress import track

from kiln.bench.result import cpu_summary
from kiln.kernels import cpu as cpu_kernels

SHAPES = [(576, 1536), (1536, 576)]  # (in_features K, out_features N)
TOKENS = [1, 2, 4, 8, 16, 32, 64, 256]
ENGINES = {"bf16 torch matmul": ("bfloat16", "torch"),
           "bf16 kiln kernel": ("bfloat16", "bf16-fp32"),
           "fp32": ("float32", "torch")}


def median_us(fn, iters: int, repeats: int = 5) -> float:
    fn()
    runs = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(iters):
            fn()
        runs.append((time.perf_counter() - t) / iters * 1e6)
    return statistics.median(runs)


def cycling(weights: list[torch.Tensor], call):
    turn = [0]

    def step():
        turn[0] = (turn[0] + 1) % len(weights)
        return call(weights[turn[0]])

    return step


def layer_rows(copies: int) -> list[dict]:
    rows = []
    for k, n in SHAPES:
        w16 = [torch.randn(n, k).bfloat16() for _ in range(copies)]
        w32 = [w.float() for w in w16]
        for m in TOKENS:
            x16, x32 = torch.randn(m, k).bfloat16(), torch.randn(m, k)
            iters = max(10, 2000 // m)
            calls = {
                "torch_bf16": (w16, lambda w, x=x16: F.linear(x, w)),
                "kiln_bf16_gemm": (w16, lambda w, x=x16: torch.ops.kiln.bf16_gemm(x, w)),
                "widen_fp32_gemm": (w16, lambda w, x=x16: F.linear(x.float(), w.float())
                                    .bfloat16()),
                "fp32_weights": (w32, lambda w, x=x32: F.linear(x, w))}
            us = {name: round(median_us(cycling(ws, call), iters), 1)
                  for name, (ws, call) in calls.items()}
            rows.append(dict(shape=f"{k}x{n}", tokens=m, us=us))
            print(json.dumps(rows[-1]), flush=True)
    return rows


def engine_rows(reps: int, threads: int) -> dict:
    from kiln import LLM, SamplingParams

    decode = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    first = SamplingParams(max_tokens=1, temperature=0)
    prompt = {"prompt_token_ids": list(range(100, 612))}  # 512 tokens
    llms = {name: LLM(dtype=dtype, linear_backend=backend, num_threads=threads,
                      enable_prefix_caching=False)
            for name, (dtype, backend) in ENGINES.items()}
    story = "Write a short story about a robot who learns to paint."
    samples: dict[str, dict[str, list[float]]] = {name: {} for name in llms}
    for _ in track(range(reps), description="engine repetitions"):
        for name, llm in llms.items():  # interleaved: drift hits every configuration alike
            for batch in (1, 8):
                t = time.perf_counter()
                llm.generate([story] * batch, decode, use_tqdm=False)
                samples[name].setdefault(f"decode_b{batch}_tok_s", []).append(
                    48 * batch / (time.perf_counter() - t))
            t = time.perf_counter()
            llm.generate([prompt], first, use_tqdm=False)
            samples[name].setdefault("ttft_512_ms", []).append((time.perf_counter() - t) * 1e3)
    return {name: {metric: round(statistics.median(v), 2) for metric, v in m.items()}
            for name, m in samples.items()}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for shape in {r["shape"] for r in result["layers"]}:
        rows = [r for r in result["layers"] if r["shape"] == shape]
        for name, style in (("torch_bf16", "o-"), ("kiln_bf16_gemm", "s-"),
                            ("widen_fp32_gemm", "^--"), ("fp32_weights", "x:")):
            ax1.plot([r["tokens"] for r in rows], [r["us"][name] for r in rows], style,
                     label=f"{shape} {name}")
    ax1.set(xscale="log", yscale="log", xlabel="tokens", ylabel="µs per call (median)",
            title="one linear layer")
    ax1.legend(fontsize=6)
    metrics = ("decode_b1_tok_s", "decode_b8_tok_s")
    width = 0.8 / len(result["engine"])
    for i, (name, m) in enumerate(result["engine"].items()):
        xs = [j + i * width for j in range(len(metrics))]
        ax2.bar(xs, [m[k] for k in metrics], width, label=name)
    ax2.set_xticks([j + width for j in range(len(metrics))], ["batch 1", "batch 8"])
    ax2.set(ylabel="decode tok/s (median)", title="default model")
    ax2.legend()
    fig.suptitle(result["cpu"]["model"])
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--copies", type=int, default=32)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/cpu_bf16.json"))
    parser.add_argument("--plot", type=Path, default=Path("benchmarks/results/cpu_bf16.png"))
    args = parser.parse_args()
    if not cpu_kernels.load():
        raise SystemExit("the kiln CPU kernels did not build")
    torch.set_num_threads(args.threads)
    result = {"cpu": cpu_summary(), "threads": args.threads, "layers": layer_rows(args.copies),
              "engine": engine_rows(args.reps, args.threads)}
    print(json.dumps(result["engine"], indent=1))
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, args.plot)


if __name__ == "__main__":
    main()
