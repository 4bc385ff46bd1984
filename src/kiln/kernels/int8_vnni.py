"""Weight-only int8 matmuls on AVX512-VNNI integer dot products (kiln::int8_vnni_mm).

`pack_int8_vnni(W)` turns int8 codes W [N, K] into uint8 [ceil(N/16), ceil(K/4), 16, 4] holding
w + 128 (padding: w = 0): each block of 16 output rows stores its k-quads in order, the 16
rows' quads side by side, so one `vpdpbusd` reads one 64-byte line and the weights stream from
memory front to back. `int8_vnni_mm` multiplies float activations by it with per-row scales:
each token's activations become 22-bit fixed point (a power-of-two scale, so bf16 activations
are held exactly) split into three signed base-256 digits, each digit one integer dot product,
combined exactly in int64 — weight-only int8 as faithful as the fp32 kernel, at a quarter of
its vector operations (kernels/cpu/gemm_int8_vnni.cpp; why: docs/decisions/0017).
Tests: tests/kernels/test_int8_vnni.py.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from kiln.kernels import cpu
from kiln.kernels.isa import cpu_isa

BLOCK = 16  # output rows per packed block
QUAD = 4  # inputs per 32-bit lane of one dot product
MAX_IN_FEATURES = 65536  # the int32 sums hold 255 * 128 * K


@functools.cache
def int8_vnni_available() -> bool:
    """This CPU reports AVX512-VNNI and kiln's kernels built here with it."""
    return ("avx512-vnni" in cpu_isa().extensions and cpu.load()
            and bool(torch.ops.kiln.int8_vnni_available()))


def int8_vnni_unsupported(out_features: int, in_features: int) -> str | None:
    """Why a layer of this shape cannot be packed, or None."""
    if in_features > MAX_IN_FEATURES:
        return (f"{in_features} input features exceed {MAX_IN_FEATURES} (the kernel's int32 "
                f"sums of 255 * 128 * K would overflow)")
    if out_features < 1 or in_features < 1:
        return f"an empty {out_features}x{in_features} layer"
    return None


def pack_int8_vnni(weight: torch.Tensor) -> torch.Tensor:
    """int8 W [N, K] as uint8 w + 128 [ceil(N/16), ceil(K/4), 16, 4]; padding holds w = 0."""
    if weight.dtype != torch.int8 or weight.dim() != 2:
        raise ValueError(f"pack_int8_vnni takes int8 [N, K], not {weight.dtype} "
                         f"{tuple(weight.shape)}")
    n, k = weight.shape
    padded = F.pad(weight, (0, -k % QUAD, 0, -n % BLOCK))
    offset = (padded.view(torch.uint8) ^ 0x80)  # w + 128 for w in -128..127
    blocks, quads = offset.shape[0] // BLOCK, offset.shape[1] // QUAD
    return offset.view(blocks, BLOCK, quads, QUAD).permute(0, 2, 1, 3).contiguous()


def unpack_int8_vnni(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """int8 W [n, k] back from `pack_int8_vnni`'s layout (exact)."""
    blocks, quads = packed.shape[:2]
    # a row's k-quad is one 32-bit word: transposing words moves 4 bytes a step (several
    # times faster than permuting bytes; it runs on every dequantized prefill call)
    words = packed.view(torch.int32).reshape(blocks, quads, BLOCK)
    rows = words.transpose(1, 2).reshape(-1).view(torch.uint8)  # (1-D: stride 1 even if quads == 1)
    rows = rows.reshape(blocks * BLOCK, quads * QUAD)[:n, :k]
    return (rows ^ 0x80).view(torch.int8).contiguous()


def int8_vnni_mm(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, n: int,
                 fp32_out: bool = False) -> torch.Tensor:
    """x float [M, K] @ (W * scale[n, 1])^T from W's packed copy: [M, n] in x's dtype, or
    fp32 with `fp32_out`."""
    return torch.ops.kiln.int8_vnni_mm(x, packed, scale, n, fp32_out)


def int8_vnni_calls() -> int:
    """How many times the kernel has run in this process (tests: the fused stack used it)."""
    return int(torch.ops.kiln.int8_vnni_calls())
