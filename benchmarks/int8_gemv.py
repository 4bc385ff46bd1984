"""One linear layer at decode token counts: kiln's int8 kernel, torch's int8 kernel, oneDNN bf16.

Times y = x @ W^T for the default model's 576 -> 1536 and 1536 -> 576 layer shapes with bf16
activations, cycling over `--copies` distinct weights per shape so that, as in a decode step
(~106 MB of int8 weights), they come from memory rather than cache (`--copies 1`: cache-hot): `torch.ops.kiln.int8_gemv` (int8 weights, fp32 scales), `torch._weight_int8pack_mm`
(int8 weights, bf16 scales; what kiln used before) and the dense bf16 path: oneDNN's
prepacked linear, or on CPUs where oneDNN cannot prepack bf16, kiln's `bf16_gemm`. Prints one JSON line per (shape, tokens, threads) with the median microseconds.

    python benchmarks/int8_gemv.py [--tokens 1,4,8] [--threads 1,2] [--iters 2000]
        [--copies 64]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from kiln.kernels import cpu as cpu_kernels
from kiln.kernels.bf16_mm import onednn_available

SHAPES = [(576, 1536), (1536, 576)]  # (in_features K, out_features N)


def median_us(fn, iters: int, repeats: int = 5) -> float:
    for _ in range(iters // 10):
        fn()
    runs = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(iters):
            fn()
        runs.append((time.perf_counter() - t) / iters * 1e6)
    return statistics.median(runs)


def cycling(make_weight, copies: int, call):
    """A no-argument function calling `call(weight)` on the next of `copies` weights."""
    weights, turn = [make_weight() for _ in range(copies)], [0]

    def step():
        turn[0] = (turn[0] + 1) % copies
        return call(weights[turn[0]])

    return step


def candidates(k: int, n: int, m: int, copies: int) -> dict:
    x = torch.randn(m, k).bfloat16()
    scale = torch.rand(n) / 100
    scale_bf16 = scale.bfloat16()

    def int8_weight():
        return torch.randint(-127, 128, (n, k), dtype=torch.int8)

    def onednn_weight():
        return torch.ops.mkldnn._reorder_linear_weight(torch.randn(n, k).bfloat16(), 1)

    out = {
        "kiln_int8_gemv": cycling(int8_weight, copies,
                                  lambda w: torch.ops.kiln.int8_gemv(x, w, scale)),
        "torch_int8pack_mm": cycling(int8_weight, copies,
                                     lambda w: torch._weight_int8pack_mm(x, w, scale_bf16)),
    }
    if onednn_available(torch.bfloat16):
        out["onednn_bf16"] = cycling(onednn_weight, copies, lambda w: (
            torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")))
    else:
        out["kiln_bf16_gemm"] = cycling(lambda: torch.randn(n, k).bfloat16(), copies,
                                        lambda w: torch.ops.kiln.bf16_gemm(x, w))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1,4,8")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--copies", type=int, default=64)
    args = parser.parse_args()
    if not cpu_kernels.load():
        raise SystemExit("the kiln CPU kernels did not build")
    for threads in map(int, args.threads.split(",")):
        torch.set_num_threads(threads)
        for k, n in SHAPES:
            for m in map(int, args.tokens.split(",")):
                times = {name: round(median_us(fn, args.iters), 1)
                         for name, fn in candidates(k, n, m, args.copies).items()}
                print(json.dumps(dict(shape=f"{k}x{n}", tokens=m, threads=threads,
                                 copies=args.copies, us=times)),
                      flush=True)


if __name__ == "__main__":
    main()
