"""Kernel-level timings of the Triton kernels against the torch path each would replace, with the
bytes each must move, on one device (for benchmarks/gpu_check.py; meaningful on a GPU only).

    python -m kiln.kernels.triton.bench [--out timings.json]

Each case checks the kernel's result against its baseline first (`max_rel_err`), then times
both. Baselines are what plain torch does: gather the paged K/V then SDPA, dequantize-free
cuBLAS on a dense bf16 weight for the GEMV (twice the weight bytes), unfused torch ops for the
norm and rotary. `copy` is a large device-to-device copy: the bandwidth ceiling of the run.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial

import torch
import torch.nn.functional as F

from kiln.kernels.triton import reference
from kiln.kernels.triton.decode_attention import choose_num_splits, paged_decode_attention
from kiln.kernels.triton.norm_rotary import fused_add_rms_norm
from kiln.kernels.triton.prefill_attention import paged_prefill_attention
from kiln.kernels.triton.quant_gemv import weight_only_gemv


@dataclass(frozen=True)
class KernelTiming:
    kernel: str
    shape: str
    triton_us: float
    baseline_us: float
    bytes_moved: int  # what the kernel must read and write at least
    max_rel_err: float  # max |kernel - baseline| / max |baseline|, same inputs

    @property
    def gbytes_per_s(self) -> float:
        return self.bytes_moved / self.triton_us / 1e3


@dataclass(frozen=True)
class Sizes:
    """Problem sizes: `full` (a Llama-8B-like layer) or `tiny` (checks the script under the
    interpreter)."""

    heads: tuple[int, int, int]  # Hq, Hkv, D
    decode_seqs: tuple[int, int]  # (sequences, keys each)
    prefill_tokens: int
    gemv: tuple[int, int]  # N, K
    hidden: int
    copy_bytes: int
    iters: int


FULL = Sizes((32, 8, 128), (64, 1024), 2048, (14336, 4096), 4096, 1 << 30, 50)
TINY = Sizes((4, 2, 64), (2, 40), 24, (32, 64), 64, 1 << 12, 1)


def time_us(fn: Callable[[], object], device: torch.device, iters: int) -> float:
    """Mean wall time of fn in microseconds (CUDA events on a GPU), after one warm-up call."""
    fn()
    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - start) / iters * 1e6
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end) / iters * 1e3


def _paged_cache(tokens: int, heads: tuple[int, int, int], device, block_size: int = 16):
    _, hkv, d = heads
    blocks = -(-tokens // block_size)
    cache = [torch.randn(blocks * block_size, hkv, d, device=device, dtype=torch.bfloat16)
             for _ in range(2)]
    return cache, blocks


def decode_case(sizes: Sizes, device) -> KernelTiming:
    (hq, hkv, d), (seqs, keys) = sizes.heads, sizes.decode_seqs
    blocks_each = -(-keys // 16)
    (k_cache, v_cache), _ = _paged_cache(seqs * blocks_each * 16, sizes.heads, device)
    table = torch.randperm(seqs * blocks_each, device=device).view(seqs, blocks_each)
    seq_lens = torch.full((seqs,), keys, device=device)
    q = torch.randn(seqs, hq, d, device=device, dtype=torch.bfloat16)
    splits = choose_num_splits(keys, seqs, hkv)
    ours = partial(paged_decode_attention, q, k_cache, v_cache, table, seq_lens, 16, d ** -0.5,
                   num_splits=splits)
    slots = torch.stack([reference.key_slots(table[s], keys, 16) for s in range(seqs)])

    def baseline():
        k, v = k_cache[slots].transpose(1, 2), v_cache[slots].transpose(1, 2)  # [S, Hkv, L, D]
        return F.scaled_dot_product_attention(q[:, :, None], k, v, scale=d ** -0.5,
                                              enable_gqa=True)[:, :, 0]
    moved = 2 * seqs * keys * hkv * d * 2
    return _timed("decode_attention", f"S={seqs} L={keys} heads={hq}/{hkv} D={d} "
                  f"splits={splits}", ours, baseline, moved, device, sizes.iters)


def prefill_case(sizes: Sizes, device) -> KernelTiming:
    (hq, hkv, d), n = sizes.heads, sizes.prefill_tokens
    (k_cache, v_cache), blocks = _paged_cache(n, sizes.heads, device)
    table = torch.randperm(blocks, device=device)[None]
    zero, lens = torch.zeros(1, dtype=torch.int64, device=device), torch.tensor([n], device=device)
    q = torch.randn(n, hq, d, device=device, dtype=torch.bfloat16)
    ours = partial(paged_prefill_attention, q, k_cache, v_cache, table, zero, lens, zero, 16,
                   d ** -0.5, max_query_len=n)
    slots = reference.key_slots(table[0], n, 16)

    def baseline():
        qs = q.transpose(0, 1)[None]
        k, v = (c[slots].transpose(0, 1)[None] for c in (k_cache, v_cache))
        out = F.scaled_dot_product_attention(qs, k, v, is_causal=True, scale=d ** -0.5,
                                             enable_gqa=True)
        return out[0].transpose(0, 1)
    moved = (2 * hq + 2 * hkv) * n * d * 2
    return _timed("prefill_attention", f"T={n} heads={hq}/{hkv} D={d}", ours, baseline, moved,
                  device, sizes.iters)


def gemv_case(sizes: Sizes, device) -> KernelTiming:
    n, k = sizes.gemv
    weight = torch.randint(-127, 128, (n, k), dtype=torch.int8, device=device)
    scale = torch.rand(n, 1, device=device) / 127
    dense = (weight.float() * scale).to(torch.bfloat16)
    x = torch.randn(1, k, device=device, dtype=torch.bfloat16)
    ours = partial(weight_only_gemv, x, weight, scale)
    baseline = partial(torch.matmul, x, dense.t())
    return _timed("int8_gemv", f"M=1 N={n} K={k}", ours, baseline, n * k + n * 4, device,
                  sizes.iters)


def norm_case(sizes: Sizes, device) -> KernelTiming:
    x = torch.randn(64, sizes.hidden, device=device, dtype=torch.bfloat16)
    residual, weight = torch.randn_like(x), torch.randn(sizes.hidden, device=device,
                                                        dtype=torch.bfloat16)
    err = relative_error(fused_add_rms_norm(x, residual.clone(), weight, 1e-6)[0],
                         reference.fused_add_rms_norm(x, residual, weight, 1e-6)[0])
    # timed calls keep adding x into the residual (in place, as in a model)
    ours = partial(fused_add_rms_norm, x, residual, weight, 1e-6)
    baseline = partial(reference.fused_add_rms_norm, x, residual, weight, 1e-6)
    return _timed("fused_add_rms_norm", f"T=64 H={sizes.hidden}", ours, baseline,
                  4 * x.numel() * 2, device, sizes.iters, err=err)


def copy_case(sizes: Sizes, device) -> KernelTiming:
    src = torch.empty(sizes.copy_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy = partial(dst.copy_, src)
    return _timed("copy", f"{sizes.copy_bytes} bytes", copy, copy, 2 * sizes.copy_bytes, device,
                  sizes.iters)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


def _timed(name, shape, ours, baseline, moved, device, iters,
           err: float | None = None) -> KernelTiming:
    if err is None:
        err = relative_error(ours(), baseline())
    return KernelTiming(name, shape, time_us(ours, device, iters),
                        time_us(baseline, device, iters), moved, err)


CASES = (copy_case, decode_case, prefill_case, gemv_case, norm_case)


def run_benchmarks(device: torch.device | str, sizes: Sizes = FULL) -> list[KernelTiming]:
    """Every case on `device` (bf16), one KernelTiming each."""
    device = torch.device(device)
    torch.manual_seed(0)
    return [case(sizes, device) for case in CASES]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write the timings here as JSON")
    parser.add_argument("--tiny", action="store_true", help="tiny sizes (a smoke run)")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = run_benchmarks(device, TINY if args.tiny else FULL)
    for row in rows:
        print(f"{row.kernel:20s} {row.shape:45s} triton {row.triton_us:9.1f} us  baseline "
              f"{row.baseline_us:9.1f} us  {row.gbytes_per_s:8.1f} GB/s  err {row.max_rel_err:.3g}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                       "rows": [asdict(r) | {"gbytes_per_s": r.gbytes_per_s} for r in rows]},
                      f, indent=2)


if __name__ == "__main__":
    main()
