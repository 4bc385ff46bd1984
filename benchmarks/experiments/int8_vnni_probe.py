"""Weight bandwidth of kiln's int8 kernels on the default model's layer shapes: the fp32-FMA
`int8_gemv` (gemm.cpp) against the AVX512-VNNI digit kernel `int8_vnni_mm`
(gemm_int8_vnni.cpp, docs/decisions/0017), with the VNNI-packed bf16 kernel `bf16_vnni_mm` as
the yardstick of what a streaming kernel reaches here.

Each (shape, tokens) cycles over enough distinct weight copies (`--mib` MiB of int8 per kernel,
twice that in bf16) that they come from memory, as in a decode step, not from cache. Prints one
JSON line per (shape, tokens, kernel): median microseconds per call and the weight bytes read
per second (GB/s; bf16 reads twice the bytes of int8 for the same layer, so compare its us too).
Run it on a quiet machine (nothing else on the cores):

    python benchmarks/experiments/int8_vnni_probe.py [--tokens 1,4,8,32,64] [--threads 2]
        [--mib 256] [--iters 300]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from kiln.kernels import cpu as cpu_kernels
from kiln.kernels.bf16_vnni import pack_vnni, vnni_available
from kiln.kernels.int8_vnni import int8_vnni_available, pack_int8_vnni

# (out_features N, in_features K) of SmolLM2-135M: qkv, o, gate_up, down
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]


def median_us(step, iters: int, repeats: int = 5) -> float:
    for _ in range(max(1, iters // 10)):
        step()
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(iters):
            step()
        runs.append((time.perf_counter() - start) / iters * 1e6)
    return statistics.median(runs)


def cycling(weights: list, call):
    """A no-argument function calling `call(weight)` on the next weight each time."""
    turn = [0]

    def step():
        turn[0] = (turn[0] + 1) % len(weights)
        return call(weights[turn[0]])

    return step


def kernels(n: int, k: int, m: int, copies: int) -> dict:
    """name -> (step, weight bytes per call)."""
    x = torch.randn(m, k).bfloat16()
    scale = torch.rand(n, 1) / 100
    codes = [torch.randint(-127, 128, (n, k), dtype=torch.int8) for _ in range(copies)]
    out = {"int8_gemv": (cycling(codes, lambda w: torch.ops.kiln.int8_gemv(x, w, scale)), n * k)}
    if int8_vnni_available():
        packed = [pack_int8_vnni(w) for w in codes]
        out["int8_vnni_mm"] = (cycling(packed, lambda w: torch.ops.kiln.int8_vnni_mm(
            x, w, scale, n, False)), n * k)
    del codes
    if vnni_available():
        dense = [pack_vnni(torch.randn(n, k).bfloat16()) for _ in range(copies)]
        out["bf16_vnni_mm"] = (cycling(dense, lambda w: torch.ops.kiln.bf16_vnni_mm(
            x, w, n, False)), 2 * n * k)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="1,4,8,32,64")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--mib", type=int, default=256, help="int8 weight MiB cycled per kernel")
    parser.add_argument("--iters", type=int, default=300)
    args = parser.parse_args()
    if not cpu_kernels.load():
        raise SystemExit("kiln's CPU kernels did not build here")
    torch.set_num_threads(args.threads)
    for n, k in SHAPES:
        copies = max(1, (args.mib << 20) // (n * k))
        for m in (int(t) for t in args.tokens.split(",")):
            for name, (step, nbytes) in kernels(n, k, m, copies).items():
                us = median_us(step, args.iters)
                print(json.dumps({"shape": f"{n}x{k}", "tokens": m, "kernel": name,
                                  "threads": args.threads, "copies": copies, "us": round(us, 2),
                                  "gb_s": round(nbytes / us / 1e3, 1)}), flush=True)


if __name__ == "__main__":
    main()
