"""Matmuls on quantized weights: torch's int8 and int4 CPU kernels and kiln's int8_gemv, beside
the plain dequantize-then-matmul reference of kiln.quant.linear.

Each function returns None when its kernel cannot run (old torch, a device or dtype it does not
take), and the caller falls back to that reference path. Tests: tests/kernels/test_quant_mm.py.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from kiln.kernels import cpu
from kiln.kernels.int8_vnni import int8_vnni_available
from kiln.kernels.isa import GemmPath, gemm_dispatch, int8_wide_min_tokens, kernel_tuning

# When torch's int8 weight-only kernel pays off on CPU (measured on 576x1536 and 1536x576,
# one thread, torch 2.13): with bf16 activations it is 3-10x faster than dequantize + matmul
# up to ~32 tokens (and ~3x faster than a dense bf16 matmul at one token), but ~2x slower at
# 128 tokens; its fp32 path is 3-50x slower than dequantize + fp32 matmul at any size.
INT8_WEIGHT_ONLY_DTYPES = (torch.bfloat16, torch.float16)
INT8_WEIGHT_ONLY_MAX_TOKENS = 32


def int8_weight_only_mm(x: torch.Tensor, weight: torch.Tensor,
                        scale: torch.Tensor) -> torch.Tensor | None:
    """x [M, K] float @ (weight int8 [N, K] * scale [N, 1])^T -> [M, N] in x's dtype, for
    bf16/fp16 x of up to INT8_WEIGHT_ONLY_MAX_TOKENS rows: torch's AVX-512 kernel, or on AMX
    CPUs from the dispatch's row count on (kiln.kernels.isa.gemm_dispatch) the weights
    dequantized to bf16 through oneDNN's AMX GEMM. None beyond: the caller's dequantize +
    matmul, which is the same oneDNN GEMM."""
    if (x.device.type != "cpu" or x.dtype not in INT8_WEIGHT_ONLY_DTYPES
            or x.shape[0] > INT8_WEIGHT_ONLY_MAX_TOKENS):
        return None
    if x.dtype == torch.bfloat16 and gemm_dispatch().path(x.shape[0]) is GemmPath.ONEDNN:
        return int8_dequantized_mm(x, weight, scale)
    return int8_weight_only_kernel_mm(x, weight, scale)


def int8_weight_only_kernel_mm(x: torch.Tensor, weight: torch.Tensor,
                               scale: torch.Tensor) -> torch.Tensor | None:
    """torch's `_weight_int8pack_mm` (AVX-512 fp32 FMAs, no AMX) at any M; None without it."""
    if not hasattr(torch, "_weight_int8pack_mm"):
        return None
    return torch._weight_int8pack_mm(x.contiguous(), weight, scale.reshape(-1).to(x.dtype))


# rows of W dequantized at a time: bounds the bf16 copy (an LM-head-sized layer would be 57 MB)
_DEQUANTIZED_TILE_ELEMENTS = 1 << 22


def int8_dequantized_mm(x: torch.Tensor, weight: torch.Tensor,
                        scale: torch.Tensor) -> torch.Tensor:
    """The oneDNN path of int8 weights: W = weight * scale dequantized in fp32 and rounded
    once to x's dtype (as kiln.quant's reference does), then torch's matmul, which is oneDNN's
    GEMM for bf16 (AMX tiles where the CPU has them), a row tile of W at a time."""
    step = max(1, _DEQUANTIZED_TILE_ELEMENTS // weight.shape[1])
    tiles = [F.linear(x, (weight[r:r + step].float() * scale[r:r + step].reshape(-1, 1).float())
                      .to(x.dtype)) for r in range(0, weight.shape[0], step)]
    return tiles[0] if len(tiles) == 1 else torch.cat(tiles, dim=-1)


# kiln's own int8 weight-only kernel (`torch.ops.kiln.int8_gemv`, kiln/kernels/cpu): each
# weight row is read once for up to 8 tokens, converted to fp32 and multiplied against x in
# fp32 (any float dtype), prefetching the next rows. Decode is memory-bound and int8 halves the
# bytes of bf16, but `_weight_int8pack_mm` streams weights from memory no faster than oneDNN's
# bf16 linear. Measured (benchmarks/int8_gemv.py, weights cycled through 64 copies so they come
# from memory as in decode; one token, bf16 x, 2-core AMD EPYC, torch 2.13): 576x1536, 1 thread
# 30 us vs 58 (torch int8) and 64 (oneDNN bf16), two threads 18 vs 26 and 36; it stays ahead
# of torch's int8 kernel up to 2 tokens, is on a par at 3-4 (fp32 FMAs bound it) and ahead
# again at 6-8. fp32 activations have no other int8 kernel (dequantize + matmul is far slower).
# KILN_INT8_GEMV_MAX_TOKENS=0 turns it off (the torch paths then serve).
INT8_GEMV_MAX_TOKENS = int(os.environ.get("KILN_INT8_GEMV_MAX_TOKENS",
                                          kernel_tuning().int8_gemv_max_tokens))


# kiln's int8 kernel on AVX512-VNNI integer dot products (kiln.kernels.int8_vnni: weights
# packed at load, activations as exact 22-bit fixed point, 3 dot products per 64 weights where
# int8_gemv spends 12 vector ops): replaces int8_gemv and torch's int8 kernel on CPUs with
# AVX512-VNNI up to this many tokens (bf16 steps beyond: `int8_wide_unbounded`, decision
# 0025); beyond, for fp32 activations, dequantize + matmul, whose dequantization
# (once per call, ~0.7 ms for a 3072x576 layer on Zen 4) pays off only on long prefill chunks:
# measured on the default model, 128 halved the 128-token prefill against 32 and left a
# 1,024-token prompt to the dequantized GEMM, which beat the kernel there 1.06 s to 1.55 s
# (docs/decisions/0017). KILN_INT8_VNNI=0 keeps the plain int8 rows and the paths above.
INT8_VNNI_MAX_TOKENS = int(os.environ.get("KILN_INT8_VNNI_MAX_TOKENS", 128))


def int8_vnni_max_tokens() -> int:
    """The most tokens `int8_vnni_mm` serves: INT8_VNNI_MAX_TOKENS, or on AMX CPUs fewer than
    the rows from which oneDNN's AMX GEMM takes over (kiln.kernels.isa.gemm_dispatch)."""
    amx = gemm_dispatch().onednn_min_tokens
    return INT8_VNNI_MAX_TOKENS if amx is None else min(INT8_VNNI_MAX_TOKENS, amx - 1)


def int8_wide_unbounded() -> bool:
    """Whether `int8_vnni_mm` serves bf16 activations at any token count: from
    `int8_wide_min_tokens()` on it widens the codes to bf16 and runs bf16 dot products, the
    scale on the fp32 sums (decision 0025), faster than dequantize + matmul at every size
    measured. Not on AMX CPUs, whose oneDNN AMX GEMM takes bf16 steps from its row count on
    (not measured against it), nor with KILN_INT8_WIDE_MIN_TOKENS=0."""
    return (gemm_dispatch().onednn_min_tokens is None and int8_wide_min_tokens() > 0
            and cpu.load() and bool(torch.ops.kiln.bf16_vnni_available()))


def int8_vnni_serves(tokens: int, dtype: torch.dtype) -> bool:
    """Whether `int8_vnni_mm` takes a step of `tokens` rows of `dtype`: up to
    `int8_vnni_max_tokens()`, and bf16 ones of any size where `int8_wide_unbounded()`."""
    return tokens <= int8_vnni_max_tokens() or (dtype == torch.bfloat16
                                                 and int8_wide_unbounded())


def int8_vnni_wanted() -> bool:
    """Whether weight-only int8 layers pack for kiln's VNNI kernel (read at each finalize)."""
    return os.environ.get("KILN_INT8_VNNI", "1") != "0" and int8_vnni_available()


def int8_gemv_mm(x: torch.Tensor, weight: torch.Tensor,
                 scale: torch.Tensor) -> torch.Tensor | None:
    """x [M, K] float @ (weight int8 [N, K] * scale [N, 1])^T -> [M, N] in x's dtype, with
    kiln's C++ kernel; None for more than INT8_GEMV_MAX_TOKENS tokens, off-CPU tensors or
    where the kiln kernels did not build."""
    if x.shape[0] > INT8_GEMV_MAX_TOKENS or x.device.type != "cpu" or not cpu.load():
        return None
    return torch.ops.kiln.int8_gemv(x, weight, scale)


def int8_gemv_fp32(x: torch.Tensor, weight: torch.Tensor,
                   scale: torch.Tensor) -> torch.Tensor | None:
    """x [M, K] float @ (weight int8 [N, K] * scale [N, 1])^T -> fp32 [M, N] at any M (an LM
    head's logits); None off-CPU or where the kiln kernels did not build."""
    if x.device.type != "cpu" or not cpu.load():
        return None
    return torch.ops.kiln.int8_gemv(x.float(), weight, scale)


def int8_int8_mm(xq: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """xq int8 [M, K] @ weight int8 [N, K]^T -> exact int32 [M, N] (W8A8 accumulation)."""
    if not hasattr(torch, "_int_mm") or xq.device.type != "cpu":
        return None
    return torch._int_mm(xq.contiguous(), weight.t())


# -- int4 weight-only: torch's CPU kernel -----------------------------------------------------
#
# `_weight_int4pack_mm_for_cpu(x, packed, g, scales_and_zeros)` computes x @ W^T with
# W[n, k] = (q[n, k] - 8) * scale[k // g, n] + zero[k // g, n], reading `packed` in a blocked
# layout made by `_convert_weight_to_int4pack_for_cpu` and scales/zeros in x's dtype. Both
# kiln int4 variants map onto it exactly: symmetric (q - 8) * s has zero 0; asymmetric
# q * s + min has zero = min + 8 * s. Measured on 3072x576 and 576x1536 (two threads, bf16,
# torch 2.13): ~1.5x faster than oneDNN's dense bf16 matmul at one token, but its cost grows
# ~linearly with tokens (~10 us per token for 3072x576), so past a few dozen tokens
# dequantizing once and running the dense matmul is faster. Its fp32 path is ~300x slower.
INT4_KERNEL_DTYPES = (torch.bfloat16, torch.float16)
INT4_KERNEL_MAX_TOKENS = 48
_INT4_KERNEL_GROUPS = (256, 128, 64, 32)  # group sizes the kernel takes, largest first
_INT4_PROBE_SHAPE = (80, 64)  # one full 64-row block plus a partial one: checks both layouts


def int4_kernel_group(group_size: int, in_features: int, out_features: int) -> int | None:
    """The kernel group size that expresses a kiln int4 layer exactly, or None.

    A kiln group of G inputs (the last one may be shorter) is G / g kernel groups sharing one
    scale, so g must divide G and in_features; the kernel also wants out_features % 16 == 0.
    """
    if out_features % 16:
        return None
    return next((g for g in _INT4_KERNEL_GROUPS
                 if group_size % g == 0 and in_features % g == 0), None)


def int4_kernel_unavailable(dtype: torch.dtype) -> str | None:
    """Why the int4 CPU kernel cannot serve activations of `dtype`, or None when it can."""
    if dtype not in INT4_KERNEL_DTYPES:
        return f"activations are {dtype}; the kernel is fast only for bf16/fp16"
    if not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        return f"torch {torch.__version__} has no _weight_int4pack_mm_for_cpu"
    if _int4_block_rows() is None:
        return "the kernel's packed layout is not one kiln can read back"
    return None


def int4_kernel_pack(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [N, K] in 0..15 -> the kernel's packed weight (uint8 [N, K / 2])."""
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)


def int4_kernel_unpack(packed: torch.Tensor, in_features: int) -> torch.Tensor:
    """The inverse of `int4_kernel_pack`: kernel layout [N, K / 2] -> uint8 codes [N, K].

    The layout (torch 2.x CPU): rows in blocks of B (64 on AVX-512, 32 otherwise); within a
    full block, byte (k, j) holds row j (low nibble) and row j + B/2 (high); a last partial
    block interleaves row pairs, byte (k, j) = rows 2j (low), 2j + 1 (high). `_int4_block_rows`
    checks this against the running torch once.
    """
    return _unpack_blocked(packed, in_features, _int4_block_rows())


def int4_weight_only_mm(x: torch.Tensor, packed: torch.Tensor, group: int,
                        scales_and_zeros: torch.Tensor) -> torch.Tensor | None:
    """x [M, K] @ W^T -> [M, N] with the kernel, or None where the reference path is faster."""
    if x.shape[0] > INT4_KERNEL_MAX_TOKENS or x.dtype != scales_and_zeros.dtype:
        return None
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x.contiguous(), packed, group,
                                                      scales_and_zeros)


def int4_scales_and_zeros(scale: torch.Tensor, minimum: torch.Tensor | None, group_size: int,
                          kernel_group: int, in_features: int,
                          dtype: torch.dtype) -> torch.Tensor:
    """kiln scale (and min) [N, ceil(K / G)] -> the kernel's [K / g, N, 2] in `dtype`.

    Symmetric: zero = 0. Asymmetric: q * s + min = (q - 8) * s + (min + 8 s). Rounding to the
    activation dtype (bf16 keeps 8 mantissa bits to fp16's 11) moves weights by at most
    ~0.4% of a group's range: the kernel path matches the reference within that.
    """
    scale = scale.float()
    zero = torch.zeros_like(scale) if minimum is None else minimum.float() + 8 * scale
    per_kernel_group = torch.arange(in_features // kernel_group) * kernel_group // group_size
    pairs = torch.stack([scale[:, per_kernel_group], zero[:, per_kernel_group]], dim=-1)
    return pairs.transpose(0, 1).contiguous().to(dtype)  # [K / g, N, 2]


def _unpack_blocked(packed: torch.Tensor, in_features: int, block: int) -> torch.Tensor:
    rows, flat, parts = packed.shape[0], packed.reshape(-1), []
    for start in range(0, rows, block):
        n = min(block, rows - start)
        tile = flat[start * in_features // 2:(start + n) * in_features // 2]
        tile = tile.reshape(in_features, n // 2)  # [K, n / 2]
        low, high = (tile & 0x0F).t(), (tile >> 4).t()  # [n / 2, K] each
        if n == block:
            parts.append(torch.cat([low, high]))  # rows j and j + n/2
        else:
            parts.append(torch.stack([low, high], dim=1).reshape(n, in_features))  # 2j, 2j+1
    return torch.cat(parts)


_BLOCK_ROWS: list[int | None] = []  # memo of `_int4_block_rows` (a one-element list once run)


def _int4_block_rows() -> int | None:
    """The kernel layout's row block, found by packing a probe and reading it back."""
    if not _BLOCK_ROWS:
        codes = torch.randint(0, 16, _INT4_PROBE_SHAPE, generator=torch.Generator().manual_seed(0),
                              dtype=torch.uint8)
        try:
            packed = int4_kernel_pack(codes)
        except (RuntimeError, AttributeError):
            packed = None
        found = None if packed is None else next(
            (b for b in (64, 32) if torch.equal(_unpack_blocked(packed, codes.shape[1], b),
                                                codes)), None)
        _BLOCK_ROWS.append(found)
    return _BLOCK_ROWS[0]
