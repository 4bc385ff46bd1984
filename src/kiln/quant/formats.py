"""Weight formats: how a float matrix W [out, in] is stored in few bits, and read back.

Every format quantizes along the input dimension, row by row (per output channel, or per
group of `g` consecutive inputs within a row; when `g` does not divide the row, the last group
is shorter, e.g. 576 = 4 * 128 + 64), so each stored tensor is either
  - per-row: shape [out, cols], sliceable by output rows (fused q/k/v shards stack by rows), or
  - per-tensor: one fp32 scalar (NVFP4's global scale), kept once per shard when fused.
`storage()` lists the tensors with their dtypes; bits per weight follow from it exactly.

Formats here (integer and fp8 grids; the FP4 microscaling formats are in microscaling.py):

  name            stored tensors (dtype, shape)                               dequantized value
  int8            weight int8 [o, i]; weight_scale fp32 [o, 1]                q * s
  fp8             weight float8_e4m3fn [o, i]; weight_scale fp32 [o, 1]       q * s
  int4-gG-sym     weight_packed uint8 [o, i/2]; weight_scale fp16 [o, ceil(i/G)]  (n - 8) * s
  int4-gG-asym    ... plus weight_min fp16 [o, ceil(i/G)]                         n * s + m

`n` is the stored nibble (0..15). Asymmetric int4 keeps an fp16 minimum per group (GGUF Q4_1
style: fp16 d and m, w = d * n + m) rather than compressed-tensors' integer zero point, so
int4-g32-asym can hold Q4_1 blocks as they are (GGUF orders the nibbles of a block
differently); hence its own tensor name, `weight_min`. "int4" alone means int4-g128-sym.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from kiln.quant.packing import (
    FP8_E4M3_MAX,
    fp8_e4m3_decode,
    pack_nibbles,
    safe_divisor,
    to_fp8_e4m3,
    unpack_nibbles,
)

Packed = dict[str, torch.Tensor]


@dataclass(frozen=True)
class StoredTensor:
    """One tensor of a format's storage: [out, cols] per output row, or a per-tensor scalar."""
    name: str
    dtype: torch.dtype
    cols: int | None  # None: one fp32 scalar per (shard of a) tensor


class WeightFormat(ABC):
    """A quantized weight format. Formats are stateless and shared; all methods are pure."""

    name: str
    group_size: int = 1         # inputs per scale (the last group of a row may be shorter)
    packs_nibbles: bool = False  # two 4-bit codes per byte: in_features must be even

    @abstractmethod
    def storage(self, out_features: int, in_features: int) -> list[StoredTensor]:
        """The tensors `quantize` returns for a [out, in] weight, in a fixed order."""

    @abstractmethod
    def quantize(self, w: torch.Tensor) -> Packed:
        """Float W [out, in] -> stored tensors (see `storage`)."""

    @abstractmethod
    def dequantize(self, packed: Packed) -> torch.Tensor:
        """Stored tensors -> float32 W [out, in]. Per-tensor scalars may also come per row, [out]."""

    def supports(self, in_features: int) -> bool:
        """Whether a layer with this many inputs can be stored."""
        return in_features % 2 == 0 or not self.packs_nibbles

    def groups(self, in_features: int) -> int:
        """Scales per row: ceil(in / group_size)."""
        return -(-in_features // self.group_size)

    def fake_quantize(self, x: torch.Tensor) -> torch.Tensor:
        """Quantize then dequantize each row of x [rows, in] on its own (dynamic per-token)."""
        return self.dequantize(self.quantize(x)).to(x.dtype)

    def bits_per_weight(self, out_features: int, in_features: int) -> float:
        """Stored bits divided by out * in, scales and scalars included."""
        bits = sum((1 if t.cols is None else out_features * t.cols) * dtype_bits(t.dtype)
                   for t in self.storage(out_features, in_features))
        return bits / (out_features * in_features)


_FORMATS: dict[str, WeightFormat] = {}


def register_format(fmt: WeightFormat, *aliases: str) -> WeightFormat:
    for name in (fmt.name, *aliases):
        _FORMATS[name] = fmt
    return fmt


def get_format(name: str) -> WeightFormat:
    if name not in _FORMATS:
        raise ValueError(f"unknown quant format {name!r}; known: {', '.join(available_formats())}")
    return _FORMATS[name]


def available_formats() -> list[str]:
    return sorted(_FORMATS)


def dtype_bits(dtype: torch.dtype) -> int:
    return torch.finfo(dtype).bits if dtype.is_floating_point else torch.iinfo(dtype).bits


def grouped(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """[out, in] -> [out, ceil(in / g), g]: the groups that share one scale.

    A short last group is padded by repeating its last value, which changes no group's min,
    max or absolute max; `ungrouped` drops the padding again.
    """
    pad = -w.shape[1] % group_size
    if pad:
        w = torch.cat([w, w[:, -1:].expand(-1, pad)], dim=1)
    return w.reshape(w.shape[0], -1, group_size)


def ungrouped(w: torch.Tensor, in_features: int) -> torch.Tensor:
    """[out, ceil(in / g), g] -> [out, in]."""
    return w.flatten(1)[:, :in_features]


class Int8Format(WeightFormat):
    """Symmetric int8, one fp32 scale per output channel: s = max|w_row| / 127."""

    name = "int8"

    def storage(self, out_features, in_features):
        return [StoredTensor("weight", torch.int8, in_features),
                StoredTensor("weight_scale", torch.float32, 1)]

    def quantize(self, w):
        w = w.float()
        scale = w.abs().amax(dim=1, keepdim=True) / 127  # [o, 1]
        q = torch.round(w / safe_divisor(scale)).clamp(-127, 127)
        return {"weight": q.to(torch.int8), "weight_scale": scale}

    def dequantize(self, packed):
        return packed["weight"].float() * packed["weight_scale"].float()


class Fp8Format(WeightFormat):
    """FP8 E4M3, one fp32 scale per output channel: s = max|w_row| / 448."""

    name = "fp8"

    def storage(self, out_features, in_features):
        return [StoredTensor("weight", torch.float8_e4m3fn, in_features),
                StoredTensor("weight_scale", torch.float32, 1)]

    def quantize(self, w):
        w = w.float()
        scale = w.abs().amax(dim=1, keepdim=True) / FP8_E4M3_MAX  # [o, 1]
        return {"weight": to_fp8_e4m3(w / safe_divisor(scale)), "weight_scale": scale}

    def dequantize(self, packed):
        return fp8_e4m3_decode(packed["weight"]) * packed["weight_scale"].float()


class Int4Format(WeightFormat):
    """Group-wise int4 with fp16 scales; symmetric (n - 8) * s or asymmetric n * s + min."""

    packs_nibbles = True

    def __init__(self, group_size: int, symmetric: bool):
        self.group_size = group_size
        self.symmetric = symmetric
        self.name = f"int4-g{group_size}-{'sym' if symmetric else 'asym'}"

    def storage(self, out_features, in_features):
        groups = self.groups(in_features)
        tensors = [StoredTensor("weight_packed", torch.uint8, in_features // 2),
                   StoredTensor("weight_scale", torch.float16, groups)]
        if not self.symmetric:
            tensors.append(StoredTensor("weight_min", torch.float16, groups))
        return tensors

    def quantize(self, w):
        g = grouped(w.float(), self.group_size)  # [o, ceil(i/G), G]
        if self.symmetric:
            scale = (g.abs().amax(dim=2, keepdim=True) / 7).half()  # [o, ceil(i/G), 1]
            nib = torch.round(g / safe_divisor(scale.float())).clamp(-8, 7) + 8
            extra = {}
        else:
            lo, hi = g.amin(dim=2, keepdim=True), g.amax(dim=2, keepdim=True)
            scale, low = ((hi - lo) / 15).half(), lo.half()  # [o, ceil(i/G), 1] each
            nib = torch.round((g - low.float()) / safe_divisor(scale.float())).clamp(0, 15)
            extra = {"weight_min": low.squeeze(2)}
        packed = pack_nibbles(ungrouped(nib.to(torch.uint8), w.shape[1]))  # [o, i/2]
        return {"weight_packed": packed, "weight_scale": scale.squeeze(2), **extra}

    def dequantize(self, packed):
        nib = unpack_nibbles(packed["weight_packed"]).float()  # [o, i]
        scale = packed["weight_scale"].float().unsqueeze(2)     # [o, ceil(i/G), 1]
        if self.symmetric:
            w = (grouped(nib, self.group_size) - 8) * scale
        else:
            w = grouped(nib, self.group_size) * scale + packed["weight_min"].float().unsqueeze(2)
        return ungrouped(w, nib.shape[1])  # [o, i]


register_format(Int8Format())
register_format(Fp8Format())
for _group in (32, 64, 128):
    for _symmetric in (True, False):
        register_format(Int4Format(_group, _symmetric))
register_format(get_format("int4-g128-sym"), "int4")
