"""Bit-level building blocks shared by the weight formats.

- Nibble packing: two 4-bit codes per uint8, the even-indexed value in the low nibble
  (the compressed-tensors / llama.cpp order), along the last dimension.
- FP4 E2M1: 1 sign, 2 exponent, 1 mantissa bit; magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6};
  code = sign << 3 | magnitude index. Rounding is to nearest, ties to the even code, and
  values past 6 saturate (the OCP MX and NVFP4 convention).
- E8M0: a power-of-two scale stored as a biased exponent in a uint8 (2**(e - 127)).

Decoding E2M1 and FP8 E4M3 goes through fp16 bit patterns: a small float's exponent and
mantissa bits, placed into an fp16's, give the same value up to a power of two (fp16 has the
larger exponent bias). This is exact, subnormals included, and ~10x faster on CPU than a table
lookup or torch's own float8 -> float32 cast.
"""

from __future__ import annotations

import torch

E2M1_MAX = 6.0
FP8_E4M3_MAX = 448.0
E8M0_BIAS = 127

# The 8 non-negative E2M1 magnitudes, indexed by the 3 low bits of a code.
E2M1_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
# Rounding boundaries, and whether the upper neighbour has the even code (wins ties).
_E2M1_MIDPOINTS = [((E2M1_GRID[i] + E2M1_GRID[i + 1]).item() / 2, (i + 1) % 2 == 0)
                   for i in range(len(E2M1_GRID) - 1)]


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes in [0, 16), [..., n] (n even) -> uint8 [..., n // 2]."""
    if codes.shape[-1] % 2:
        raise ValueError(f"cannot pack an odd number of nibbles ({codes.shape[-1]})")
    codes = codes.to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n // 2] -> uint8 codes [..., n]; the inverse of `pack_nibbles`."""
    pairs = torch.stack((packed & 0x0F, packed >> 4), dim=-1)  # [..., n // 2, 2]
    return pairs.flatten(-2)


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """float [...] -> uint8 E2M1 codes [...] (round to nearest even, saturating at +-6)."""
    mag = x.abs().float()
    index = torch.zeros_like(mag, dtype=torch.uint8)
    # Count the midpoints between grid neighbours that `mag` passes. At a tie the even
    # neighbour wins: ">" keeps ties on the lower side, ">=" sends them to the upper one.
    for mid, even_is_upper in _E2M1_MIDPOINTS:
        index += (mag >= mid) if even_is_upper else (mag > mid)
    return index | ((x < 0).to(torch.uint8) << 3)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """uint8 E2M1 codes [...] -> float32 values [...]."""
    c = codes.to(torch.int16)
    bits = ((c & 0x07) << 9) | ((c & 0x08) << 12)  # exp+mantissa -> fp16 bits 11..9, sign -> 15
    return bits.view(torch.float16).float() * 2.0 ** 14  # fp16 bias 15 vs E2M1 bias 1


def fp8_e4m3_decode(x: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn [...] -> float32 [...] (the NaN codes, never written here, read as +-480)."""
    b = x.view(torch.uint8).to(torch.int16)
    bits = ((b & 0x7F) << 7) | ((b & 0x80) << 8)  # exp+mantissa -> fp16 bits 13..7, sign -> 15
    return bits.view(torch.float16).float() * 2.0 ** 8  # fp16 bias 15 vs E4M3 bias 7


def e8m0_decode(exponents: torch.Tensor) -> torch.Tensor:
    """uint8 biased exponents [...] -> float32 powers of two 2**(e - 127) [...]."""
    return exponents.view(torch.float8_e8m0fnu).float()


def e8m0_encode_floor(amax: torch.Tensor, elem_emax: int) -> torch.Tensor:
    """Shared MX exponent for blocks with absolute maximum `amax`: floor(log2 amax) - emax.

    This is the OCP MX v1.0 rule: the largest value lands in [2**emax, 2**(emax+1)) of the
    element grid, so a block may saturate at the element maximum. All-zero blocks get the
    smallest scale. Returns uint8 biased exponents.
    """
    _, exp = torch.frexp(amax.float())  # amax = m * 2**exp, m in [0.5, 1)
    shared = exp - 1 - elem_emax
    shared = torch.where(amax > 0, shared, torch.full_like(shared, -E8M0_BIAS))
    return (shared.clamp(-E8M0_BIAS, E8M0_BIAS) + E8M0_BIAS).to(torch.uint8)


def to_fp8_e4m3(x: torch.Tensor) -> torch.Tensor:
    """float -> float8_e4m3fn, saturating (a plain cast turns values past 448 into NaN)."""
    return x.float().clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)


def safe_divisor(scale: torch.Tensor) -> torch.Tensor:
    """Scales of all-zero groups are 0; divide by 1 there instead (the codes come out 0)."""
    return torch.where(scale == 0, torch.ones_like(scale), scale)
