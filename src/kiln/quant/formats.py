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

Quantizing is two steps, so calibrated rounding (kiln.quant.gptq) can fix a group's grid and
then round its columns one at a time: `params(w)` chooses the grid of each group (scales,
minimums, global scale: every stored tensor but the codes), `codes(w, params)` rounds onto it.
`snap(w, params)` is the rounded value itself (no packing, so any number of columns), and
`quantize(w, params)` the stored tensors.

`params(w)` is the absmax rule: each group's grid spans its min and max exactly. `fit(w,
importance)` searches instead (the 4-bit formats; clipping search, as AWQ's and GPTQ's "mse"
options do): each group's range is shrunk by each factor of the format's `shrinks`, and the
group keeps the grid whose rounding error, weighted per input by `importance` (the mean
squared input activation: GPTQ passes diag H), is smallest. The outliers of a group then no
longer stretch the grid that all its other values round onto. Every candidate is made by
`params`, so it is representable (fp8 / e8m0 scales) by construction, and absmax (shrink 1)
is always a candidate: the fitted grid never has the larger weighted error.
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
    per_channel: bool = False   # one scale per output row (group_size is then unused)
    packs_nibbles: bool = False  # two 4-bit codes per byte: in_features must be even
    code_name: str = "weight_packed"  # the stored tensor holding the codes
    shrinks: tuple[float, ...] = ()  # range factors `fit` tries besides 1 (none: absmax only)

    @abstractmethod
    def storage(self, out_features: int, in_features: int) -> list[StoredTensor]:
        """The tensors `quantize` returns for a [out, in] weight, in a fixed order."""

    @abstractmethod
    def params(self, w: torch.Tensor, shrink: float = 1.0) -> Packed:
        """Float W [out, cols] -> the grid of each of its groups: every stored tensor but the
        codes (per-group tensors [out, groups], per-channel [out, 1], per-tensor [1]).
        The grid spans each group's range times `shrink` (1: its min and max)."""

    @abstractmethod
    def codes(self, w: torch.Tensor, params: Packed) -> torch.Tensor:
        """W [out, cols] rounded onto `params`' grid -> codes [out, cols], unpacked
        (nibbles as uint8 0..15), in the groups `params` describe."""

    @abstractmethod
    def decode(self, codes: torch.Tensor, params: Packed) -> torch.Tensor:
        """Codes [out, cols] and their grid -> float32 W [out, cols]. Per-tensor scalars may
        also come per row, [out]."""

    def quantize(self, w: torch.Tensor, params: Packed | None = None) -> Packed:
        """Float W [out, in] -> stored tensors (see `storage`), on `params` or W's own grid."""
        params = self.params(w) if params is None else params
        codes = self.codes(w.float(), params)
        return {self.code_name: pack_nibbles(codes) if self.packs_nibbles else codes, **params}

    def dequantize(self, packed: Packed) -> torch.Tensor:
        """Stored tensors -> float32 W [out, in]."""
        codes = packed[self.code_name]
        codes = unpack_nibbles(codes) if self.packs_nibbles else codes
        return self.decode(codes, {k: v for k, v in packed.items() if k != self.code_name})

    def snap(self, w: torch.Tensor, params: Packed) -> torch.Tensor:
        """W [out, cols] rounded onto `params`' grid, as float32 values (any cols)."""
        return self.decode(self.codes(w.float(), params), params)

    def fit(self, w: torch.Tensor, importance: torch.Tensor | None = None,
            **fixed) -> Packed:
        """The grid of each group of W [out, cols] with the least rounding error, weighted by
        `importance` [cols] (None: unweighted), among `params` at shrink 1 and `shrinks`.
        `fixed`: per-tensor parts of the grid, passed to `params` as they are."""
        w = w.float()
        best = self.params(w, **fixed)
        if not self.shrinks:
            return best
        error = self.group_error(w, best, importance)  # [out, groups]
        for shrink in self.shrinks:
            candidate = self.params(w, shrink=shrink, **fixed)
            candidate_error = self.group_error(w, candidate, importance)
            better = candidate_error < error
            error = torch.where(better, candidate_error, error)
            best = {k: torch.where(better, v, best[k]) if v.dim() == 2 else v
                    for k, v in candidate.items()}  # per-tensor parts (1-dim) are the same
        return best

    def group_error(self, w: torch.Tensor, params: Packed,
                    importance: torch.Tensor | None = None) -> torch.Tensor:
        """Squared rounding error of W [out, cols] on `params`, summed per group -> [out,
        groups], each input's term weighted by `importance` [cols] (None: all 1)."""
        err = (self.snap(w, params) - w).pow(2)  # [out, cols]
        if importance is not None:
            err = err * importance.float()
        width = err.shape[1] if self.per_channel else self.group_size
        err = torch.nn.functional.pad(err, (0, -err.shape[1] % width))  # short group: 0s
        return err.reshape(err.shape[0], -1, width).sum(dim=2)

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
    max or absolute max; `ungrouped` drops the padding again. A row of at most g values is one
    group as it is ([out, 1, in], no padding: GPTQ rounds single columns this way).
    """
    if w.shape[1] <= group_size:
        return w.unsqueeze(1)
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
    per_channel = True
    code_name = "weight"

    def storage(self, out_features, in_features):
        return [StoredTensor("weight", torch.int8, in_features),
                StoredTensor("weight_scale", torch.float32, 1)]

    def params(self, w, shrink=1.0):
        return {"weight_scale": w.float().abs().amax(dim=1, keepdim=True) * shrink / 127}

    def codes(self, w, params):
        q = torch.round(w / safe_divisor(params["weight_scale"]))
        return q.clamp(-127, 127).to(torch.int8)

    def decode(self, codes, params):
        return codes.float() * params["weight_scale"].float()


class Fp8Format(WeightFormat):
    """FP8 E4M3, one fp32 scale per output channel: s = max|w_row| / 448."""

    name = "fp8"
    per_channel = True
    code_name = "weight"

    def storage(self, out_features, in_features):
        return [StoredTensor("weight", torch.float8_e4m3fn, in_features),
                StoredTensor("weight_scale", torch.float32, 1)]

    def params(self, w, shrink=1.0):
        amax = w.float().abs().amax(dim=1, keepdim=True)  # [o, 1]
        return {"weight_scale": amax * shrink / FP8_E4M3_MAX}

    def codes(self, w, params):
        return to_fp8_e4m3(w / safe_divisor(params["weight_scale"]))

    def decode(self, codes, params):
        return fp8_e4m3_decode(codes) * params["weight_scale"].float()


class Int4Format(WeightFormat):
    """Group-wise int4 with fp16 scales; symmetric (n - 8) * s or asymmetric n * s + min."""

    packs_nibbles = True
    shrinks = tuple(1 - 0.02 * k for k in range(1, 21))  # 0.98 .. 0.60

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

    def params(self, w, shrink=1.0):
        g = grouped(w.float(), self.group_size)  # [o, ceil(i/G), G]
        if self.symmetric:
            return {"weight_scale": (g.abs().amax(dim=2) * shrink / 7).half()}  # [o, ceil(i/G)]
        lo, hi = g.amin(dim=2), g.amax(dim=2)
        span = (hi - lo) * shrink  # shrunk about the group's midpoint
        return {"weight_scale": (span / 15).half(), "weight_min": ((hi + lo - span) / 2).half()}

    def codes(self, w, params):
        g = grouped(w, self.group_size)  # [o, ceil(i/G), G]
        scale = safe_divisor(params["weight_scale"].float().unsqueeze(2))
        if self.symmetric:
            nib = torch.round(g / scale).clamp(-8, 7) + 8
        else:
            nib = torch.round((g - params["weight_min"].float().unsqueeze(2)) / scale)
            nib = nib.clamp(0, 15)
        return ungrouped(nib.to(torch.uint8), w.shape[1])  # [o, i]

    def decode(self, codes, params):
        nib = grouped(codes.float(), self.group_size)  # [o, ceil(i/G), G]
        scale = params["weight_scale"].float().unsqueeze(2)
        if self.symmetric:
            w = (nib - 8) * scale
        else:
            w = nib * scale + params["weight_min"].float().unsqueeze(2)
        return ungrouped(w, codes.shape[1])  # [o, i]


register_format(Int8Format())
register_format(Fp8Format())
for _group in (32, 64, 128):
    for _symmetric in (True, False):
        register_format(Int4Format(_group, _symmetric))
register_format(get_format("int4-g128-sym"), "int4")
