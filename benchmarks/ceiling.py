"""What this CPU can do at most: memory read bandwidth and matrix peak, and the batch-1 decode
ceiling they imply for the default model, so every speed figure is also a fraction of it.

- Bandwidth: a streaming read of a buffer far larger than the last-level cache (default
  1 GiB) with `--threads` threads, median of `--runs`: a small C++ loop (8 independent 64-bit
  accumulators, vectorized by -O3 -march=native; built once with torch's cpp_extension) and
  torch's fp32 sum, each on ordinary pages and on transparent huge pages (where kiln keeps
  its weights, kiln.models.arena); the fastest is the figure (reported side by side).
- Matrix peak at one large square shape (`--size`): bf16 GEMM through oneDNN as kiln's dense
  layers run it (prepacked weights: AMX tiles where the CPU has them) and again with oneDNN
  capped at AVX512-BF16 (`ONEDNN_MAX_CPU_ISA`, in a child process: the AVX-512 figure on an AMX
  CPU); the LM head's fp32-output oneDNN path; kiln's own `bf16_gemm_f32` kernel; int8 GEMM
  (`torch._int_mm`: oneDNN's int8 gemm, AMX-INT8 or VNNI) with and without the cap; fp32 GEMM;
  kiln's VNNI-packed bf16 GEMM (the dense layers on AVX512-BF16 CPUs without AMX, 0013). Each
  row names the oneDNN kernel that ran (from ONEDNN_VERBOSE). Beside them, where the CPU has
  AVX512-BF16, the rate at which the cores issue `vdpbf16ps` with every operand in registers
  (24 independent accumulators per thread): what no bf16 GEMM on those units can pass.
- The dispatch crossover (kiln.kernels.isa.gemm_dispatch): for the GEMMs the row count sends
  to oneDNN on AMX CPUs (the LM head's fp32-output product, int8 weight-only layers) at the
  default model's shapes, microseconds per call of kiln's path and oneDNN's at each row count
  of `--rows`, and the first row count from which oneDNN stays faster: the figure for
  KernelTuning.amx_min_tokens on this CPU.
- The dense bf16 layers by rows: oneDNN's prepacked linear at the default model's MLP shape,
  weights cycled through copies so they come from memory as in decode, µs per call and the
  kernel oneDNN picked at each row count; on AMX CPUs again capped at AVX512-BF16, which says
  whether AMX helps or hurts at decode's few rows (oneDNN serves those layers at every M).
- Decode ceiling: bytes one batch-1 decode step reads (the checkpoint's weights; with tied
  embeddings the table is the LM head, read whole; the KV cache, small at short context, is
  left out) / bandwidth = tokens per second.

Prints the CPU model and ISA (kiln.kernels.isa) and a table; writes --json and a PNG beside it.
Run it on a quiet machine (its figures are meaningless under contention):

    python benchmarks/ceiling.py [--threads 2] [--size 4096] [--runs 5] [--buffer-mib 1024]
        [--out benchmarks/results/ceiling.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import torch

from kiln.kernels import cpu as cpu_kernels
from kiln.kernels import quant_mm
from kiln.kernels.bf16_mm import onednn_available, onednn_bf16_linear_fp32
from kiln.kernels.bf16_vnni import pack_vnni, vnni_available, vnni_mm
from kiln.kernels.isa import cpu_isa, onednn_implementations
from kiln.models.arena import huge_page_buffer

# oneDNN's ISA names (ONEDNN_MAX_CPU_ISA) for "everything but AMX"
NO_AMX_CAP = "AVX512_CORE_BF16"

_READ_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>

// Reads every 64-bit word of `buffer` once, 8 independent sums so the loop is load-bound.
int64_t read_all(const at::Tensor& buffer) {
  const auto* words = reinterpret_cast<const uint64_t*>(buffer.data_ptr());
  const int64_t n = buffer.numel() * buffer.element_size() / 8;
  std::atomic<uint64_t> total{0};
  at::parallel_for(0, n / 8, 1 << 16, [&](int64_t begin, int64_t end) {
    uint64_t s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int64_t i = begin; i < end; ++i)
      for (int j = 0; j < 8; ++j) s[j] += words[i * 8 + j];
    uint64_t local = 0;
    for (int j = 0; j < 8; ++j) local += s[j];
    total += local;
  });
  return static_cast<int64_t>(total.load());
}
"""


_DOT_PEAK_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <atomic>
#include <chrono>

// GFLOP/s of vdpbf16ps issued back to back by every thread, operands in registers: 24
// accumulators (8 rows x 3 blocks, the shape of kiln's VNNI tile), 64 flops per instruction.
double bf16_dot_peak(int64_t iters) {
#if defined(__AVX512BF16__)
  const int64_t threads = at::get_num_threads();
  std::atomic<int64_t> sink{0};
  const auto start = std::chrono::steady_clock::now();
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      __m512 acc[24];
      for (int i = 0; i < 24; ++i) acc[i] = _mm512_setzero_ps();
      const __m512bh w0 = (__m512bh)_mm512_set1_epi32(0x3f803f80);
      const __m512bh w1 = (__m512bh)_mm512_set1_epi32(0x3f813f81);
      const __m512bh w2 = (__m512bh)_mm512_set1_epi32(0x3f823f82);
      __m512i xi = _mm512_set1_epi32(0x3c003c00);
      for (int64_t it = 0; it < iters; ++it) {
        const __m512bh x = (__m512bh)xi;
        for (int m = 0; m < 8; ++m) {
          acc[3 * m] = _mm512_dpbf16_ps(acc[3 * m], w0, x);
          acc[3 * m + 1] = _mm512_dpbf16_ps(acc[3 * m + 1], w1, x);
          acc[3 * m + 2] = _mm512_dpbf16_ps(acc[3 * m + 2], w2, x);
        }
        asm volatile("" : "+v"(xi));  // a fresh operand each round: nothing hoisted
      }
      __m512 sum = _mm512_setzero_ps();
      for (int i = 0; i < 24; ++i) sum = _mm512_add_ps(sum, acc[i]);
      sink += static_cast<int64_t>(_mm512_reduce_add_ps(sum)) & 1;
    }
  });
  const double seconds = std::chrono::duration<double>(
      std::chrono::steady_clock::now() - start).count();
  return static_cast<double>(iters) * 24 * 64 * threads / seconds / 1e9 + 0 * sink.load();
#else
  return 0.0;
#endif
}
"""


@dataclass(frozen=True)
class MatrixFigure:
    name: str  # what ran: "bf16 oneDNN (prepacked)", ...
    tflops: float  # median over runs; int8 in tera-ops
    kernel: str  # the oneDNN kernel(s) that ran, or who else did


def median_seconds(fn: Callable[[], object], runs: int) -> float:
    fn()  # warm: primitives created, pages touched
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


# -- bandwidth -------------------------------------------------------------------------------------


def read_loop() -> Callable[[torch.Tensor], int] | None:
    """The C++ read loop, built once (None where no compiler works)."""
    try:
        from torch.utils.cpp_extension import load_inline

        module = load_inline("kiln_ceiling_read", cpp_sources=_READ_SOURCE, functions=["read_all"],
                             extra_cflags=["-O3", "-march=native"], verbose=False)
        return module.read_all
    except Exception as exc:  # noqa: BLE001 - any build failure leaves torch's figure
        print(f"C++ read loop unavailable ({exc}); torch's sum only", file=sys.stderr)
        return None


def bandwidth(buffer_mib: int, runs: int, use_cpp: bool) -> dict[str, float]:
    """GB/s read by each method (median of `runs`), and "best" of them."""
    buffer = torch.ones(buffer_mib * (1 << 20) // 4, dtype=torch.float32)  # touched: resident
    # the same read from huge pages, as kiln holds its weights (kiln.models.arena)
    huge = huge_page_buffer(buffer.nbytes).view(torch.float32).fill_(1.0)
    gigabytes = buffer.numel() * 4 / 1e9
    figures = {"torch_sum": gigabytes / median_seconds(buffer.sum, runs),
               "torch_sum_huge_pages": gigabytes / median_seconds(huge.sum, runs)}
    loop = read_loop() if use_cpp else None
    if loop is not None:
        figures["cpp_read"] = gigabytes / median_seconds(lambda: loop(buffer), runs)
        figures["cpp_read_huge_pages"] = gigabytes / median_seconds(lambda: loop(huge), runs)
    figures["best"] = max(figures.values())
    return {k: round(v, 2) for k, v in figures.items()}


# -- matrix peak -------------------------------------------------------------------------------------


def matrix_candidates(n: int) -> dict[str, Callable[[], object]]:
    """Name -> one n x n x n product (each built once here, outside the timing)."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(n, n, generator=g), torch.randn(n, n, generator=g)
    a16, b16 = a.bfloat16(), b.bfloat16()
    a8 = torch.randint(-127, 128, (n, n), generator=g, dtype=torch.int8)
    b8 = torch.randint(-127, 128, (n, n), generator=g, dtype=torch.int8)
    found: dict[str, Callable[[], object]] = {}
    if onednn_available(torch.bfloat16):
        packed = torch.ops.mkldnn._reorder_linear_weight(b16, 1)
        found["bf16 oneDNN (prepacked)"] = lambda: torch.ops.mkldnn._linear_pointwise(
            a16, packed, None, "none", [], "")
        found["bf16->fp32 oneDNN (LM head path)"] = lambda: onednn_bf16_linear_fp32(a16, b16)
    if cpu_kernels.load():
        found["bf16->fp32 kiln bf16_gemm_f32"] = lambda: torch.ops.kiln.bf16_gemm_f32(a16, b16)
        if vnni_available():
            vnni = pack_vnni(b16)
            found["bf16 kiln VNNI-packed (bf16_vnni_mm)"] = lambda: vnni_mm(a16, vnni, n)
    found["int8 torch._int_mm (oneDNN)"] = lambda: torch._int_mm(a8, b8)
    found["fp32 torch matmul"] = lambda: a @ b
    return found


def dot_peak(runs: int) -> MatrixFigure | None:
    """The vdpbf16ps issue rate with operands in registers (None without AVX512-BF16 or a
    compiler)."""
    if "avx512-bf16" not in cpu_isa().extensions:
        return None
    try:
        from torch.utils.cpp_extension import load_inline

        module = load_inline("kiln_ceiling_dot_peak", cpp_sources=_DOT_PEAK_SOURCE,
                             functions=["bf16_dot_peak"],
                             extra_cflags=["-O3", "-march=native", "-fopenmp"],
                             extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as exc:  # noqa: BLE001 - the GEMM figures stand without it
        print(f"dot-product peak unavailable ({exc})", file=sys.stderr)
        return None
    module.bf16_dot_peak(1_000_000)  # warm: threads up, clocks settled
    gflops = statistics.median(module.bf16_dot_peak(20_000_000) for _ in range(runs))
    return MatrixFigure("bf16 vdpbf16ps peak (kiln loop, registers only)",
                        round(gflops / 1e3, 3), "kiln C++")


def kernel_of(fn: Callable[[], object], name: str) -> str:
    if "kiln" in name:
        return "kiln C++"
    return " ".join(sorted(set(onednn_implementations(fn)))) or "not oneDNN (MKL/ATen)"


def matrix_peak(n: int, runs: int, only: str | None = None) -> list[MatrixFigure]:
    figures = []
    for name, fn in matrix_candidates(n).items():
        if only is not None and name != only:
            continue
        seconds = median_seconds(fn, runs)
        figures.append(MatrixFigure(name, round(2 * n ** 3 / seconds / 1e12, 3),
                                    kernel_of(fn, name)))
    return figures


def capped(n: int, runs: int, threads: int, names: list[str]) -> list[MatrixFigure]:
    """The same products in a child process with oneDNN capped below AMX."""
    env = dict(os.environ, ONEDNN_MAX_CPU_ISA=NO_AMX_CAP)
    figures = []
    for name in names:
        out = subprocess.run([sys.executable, __file__, "--child", name, "--size", str(n),
                              "--runs", str(runs), "--threads", str(threads)],
                             env=env, capture_output=True, text=True, check=True)
        for row in json.loads(out.stdout.strip().splitlines()[-1]):
            figures.append(MatrixFigure(f"{row['name']} [cap {NO_AMX_CAP}]", row["tflops"],
                                        row["kernel"]))
    return figures


# -- dispatch crossover ------------------------------------------------------------------------------


def crossover(model_dir: Path, rows: list[int], runs: int) -> list[dict]:
    """Per GEMM the dispatch routes: µs per call of each path at each row count, and the
    first row count from which oneDNN is faster at every larger one measured (None: never)."""
    config = json.loads((model_dir / "config.json").read_text())
    hidden, inter, vocab = (config["hidden_size"], config["intermediate_size"],
                            config["vocab_size"])
    g = torch.Generator().manual_seed(0)
    head = torch.randn(vocab, hidden, generator=g).bfloat16()
    w8 = torch.randint(-127, 128, (inter, hidden), generator=g, dtype=torch.int8)
    scale = torch.rand(inter, 1, generator=g) / 100
    paths = {
        f"LM head {vocab}x{hidden} fp32 out": (
            (lambda x: torch.ops.kiln.bf16_gemm_f32(x, head)) if cpu_kernels.load() else None,
            lambda x: onednn_bf16_linear_fp32(x, head)),
        f"int8 weight-only {inter}x{hidden}": (
            lambda x: quant_mm.int8_weight_only_kernel_mm(x, w8, scale),
            lambda x: quant_mm.int8_dequantized_mm(x, w8, scale)),
    }
    report = []
    for name, (kiln, onednn) in paths.items():
        if kiln is None:
            continue
        us = {}
        for m in rows:
            x = torch.randn(m, hidden, generator=g).bfloat16()
            us[m] = {"kiln": round(median_seconds(partial(kiln, x), runs) * 1e6, 1),
                     "onednn": round(median_seconds(partial(onednn, x), runs) * 1e6, 1)}
        wins = [m for i, m in enumerate(rows)
                if all(us[r]["onednn"] < us[r]["kiln"] for r in rows[i:])]
        report.append({"gemm": name, "us": us, "onednn_from_rows": wins[0] if wins else None})
    return report


# -- dense bf16 layers by rows ---------------------------------------------------------------------


def dense_rows(model_dir: Path, rows: list[int], runs: int, copies: int = 64) -> dict:
    """µs per call and oneDNN's kernel for the prepacked MLP up-projection at each row count,
    cycling through `copies` packed weights (64 x 1.8 MB: more than a 2-core slice's cache)."""
    if not onednn_available(torch.bfloat16):
        return {}
    config = json.loads((model_dir / "config.json").read_text())
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    packed = [torch.ops.mkldnn._reorder_linear_weight(torch.randn(inter, hidden).bfloat16(), 1)
              for _ in range(copies)]
    report = {}
    for m in rows:
        x, turn = torch.randn(m, hidden).bfloat16(), [0]

        def call(x=x, turn=turn):
            turn[0] = (turn[0] + 1) % copies
            return torch.ops.mkldnn._linear_pointwise(x, packed[turn[0]], None, "none", [], "")

        per_call = median_seconds(lambda: [call() for _ in range(copies)], runs) / copies
        report[m] = {"us": round(per_call * 1e6, 1),
                     "kernel": " ".join(sorted(set(onednn_implementations(call))))}
    return report


def capped_dense(args: argparse.Namespace) -> dict:
    """`dense_rows` in a child process with oneDNN capped below AMX."""
    out = subprocess.run([sys.executable, __file__, "--child-dense", "--rows", args.rows,
                          "--runs", str(args.runs), "--threads", str(args.threads),
                          "--model", str(args.model)],
                         env=dict(os.environ, ONEDNN_MAX_CPU_ISA=NO_AMX_CAP),
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


# -- decode ceiling --------------------------------------------------------------------------------


def decode_bytes(model_dir: Path) -> int:
    """Bytes of weights one batch-1 decode step reads: every tensor of the checkpoint but an
    untied embedding table (one row of it is read)."""
    from safetensors import safe_open

    config = json.loads((model_dir / "config.json").read_text())
    tied = config.get("tie_word_embeddings", False)
    sizes = {torch.bfloat16: 2, torch.float16: 2, torch.float32: 4, torch.int8: 1}
    total = 0
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                if key.endswith("embed_tokens.weight") and not tied:
                    continue
                piece = f.get_slice(key)
                numel = 1
                for d in piece.get_shape():
                    numel *= d
                dtype = getattr(torch, {"BF16": "bfloat16", "F16": "float16", "F32": "float32",
                                        "I8": "int8"}[piece.get_dtype()])
                total += numel * sizes[dtype]
    return total


# -- report ------------------------------------------------------------------------------------------


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.8), width_ratios=(1, 3))
    bw = {k: v for k, v in result["bandwidth_gb_s"].items() if k != "best"}
    ax1.bar(list(bw), list(bw.values()), color="tab:blue")
    ax1.set(ylabel="GB/s (median)", title=f"read bandwidth, {result['threads']} threads")
    rows = result["matrix"]
    ax2.barh([r["name"] for r in rows], [r["tflops"] for r in rows], color="tab:orange")
    ax2.set(xlabel="TFLOP/s (int8: TOP/s), median",
            title=f"{result['size']}^3 GEMM, {result['threads']} threads")
    ax2.tick_params(axis="y", labelsize=7)
    decode = result["decode"]
    fig.suptitle(f"{result['cpu']['model']} [{result['cpu']['level']}]: batch-1 decode ceiling "
                 f"{decode['tok_s']} tok/s ({decode['megabytes']} MB per token)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--size", type=int, default=4096, help="square GEMM size")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--buffer-mib", type=int, default=1024)
    parser.add_argument("--no-cpp", action="store_true", help="torch's sum only")
    parser.add_argument("--rows", default="1,2,4,8,16,32,64,128",
                        help="row counts of the dispatch crossover ('' skips it)")
    parser.add_argument("--model", type=Path, default=None,
                        help="checkpoint directory (default: the bundled default model)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/ceiling.json"))
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child-dense", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",") if r]
    if args.child_dense:  # `dense_rows` for the capped run, as JSON on stdout
        print(json.dumps(dense_rows(args.model, rows, args.runs)))
        return
    if args.child is not None:  # one product for `capped`, as JSON on stdout
        print(json.dumps([asdict(f) for f in matrix_peak(args.size, args.runs, args.child)]))
        return

    isa = cpu_isa()
    print(f"cpu: {isa.describe()} [level {isa.level}], {args.threads} threads")
    if args.model is None:
        from kiln.models.default import default_model_path

        args.model = default_model_path()
    result = measure(args, rows)
    print_report(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    plot(result, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


def measure(args: argparse.Namespace, rows: list[int]) -> dict:
    """Every figure of the module docstring, as the JSON the run writes."""
    isa = cpu_isa()
    bw = bandwidth(args.buffer_mib, args.runs, not args.no_cpp)
    matrix = matrix_peak(args.size, args.runs)
    peak = dot_peak(args.runs)
    if peak is not None:
        matrix.append(peak)
    dense = {"default": dense_rows(args.model, rows, args.runs)}
    if "amx-bf16" in isa.extensions:  # the AVX-512 figures beside the AMX ones
        matrix += capped(args.size, args.runs, args.threads,
                         [f.name for f in matrix if "oneDNN" in f.name])
        if rows:
            dense[f"cap {NO_AMX_CAP}"] = capped_dense(args)
    nbytes = decode_bytes(args.model)
    return {
        "cpu": {"model": isa.model_name, "vendor": isa.vendor, "family": isa.family,
                "model_id": isa.model, "isa": list(isa.extensions), "level": isa.level},
        "threads": args.threads, "size": args.size, "runs": args.runs,
        "buffer_mib": args.buffer_mib, "bandwidth_gb_s": bw,
        "matrix": [asdict(f) for f in matrix],
        "crossover": crossover(args.model, rows, args.runs) if rows else [],
        "dense_by_rows": dense,
        "decode": {"model": args.model.name, "megabytes": round(nbytes / 1e6, 1),
                   "tok_s": round(bw["best"] * 1e9 / nbytes, 1)},
        "torch": torch.__version__,
    }


def print_report(result: dict) -> None:
    bw = result["bandwidth_gb_s"]
    print("read bandwidth: " + ", ".join(f"{k} {v} GB/s" for k, v in bw.items()))
    for f in result["matrix"]:
        print(f"  {f['name']:<48} {f['tflops']:8.3f} TFLOP/s   {f['kernel']}")
    for c in result["crossover"]:
        print(f"  {c['gemm']}: oneDNN faster from {c['onednn_from_rows']} rows; µs kiln/oneDNN "
              + ", ".join(f"{m}: {v['kiln']}/{v['onednn']}" for m, v in c["us"].items()))
    for isa_name, by_rows in result["dense_by_rows"].items():
        print(f"  dense bf16 MLP layer, oneDNN {isa_name}: "
              + ", ".join(f"{m}: {v['us']} µs {v['kernel']}" for m, v in by_rows.items()))
    decode = result["decode"]
    print(f"batch-1 decode ceiling: {decode['megabytes']} MB per token / {bw['best']} GB/s = "
          f"{decode['tok_s']} tok/s")

if __name__ == "__main__":
    main()
