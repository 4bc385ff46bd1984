"""FP4 (E2M1) microscaling formats: small blocks of 4-bit floats sharing one scale.

  name    stored tensors (dtype, shape)                         dequantized value
  nvfp4   weight_packed uint8 [o, i/2]                          e2m1(n) * s_b / g
          weight_scale float8_e4m3fn [o, ceil(i/16)]  (s_b, one per 16 values)
          weight_global_scale fp32 [1]                (g, one per tensor; per shard when fused)
  mxfp4   weight_packed uint8 [o, i/2]                          e2m1(n) * 2**(e - 127)
          weight_scale uint8 [o, ceil(i/32)]          (e, an E8M0 exponent per 32 values)

NVFP4 follows compressed-tensors' convention: the global scale is a divisor chosen so the
largest block scale fills the fp8 range, g = (448 * 6) / max|W|, and s_b = fp8(max|block| / 6 * g).
MXFP4 follows the OCP MX v1.0 spec: the shared exponent is floor(log2 max|block|) - 2 (2 is
E2M1's largest exponent), so a block's largest values may saturate at 6.

Those are the absmax rules (`params`); `fit` (kiln.quant.formats) searches around them: NVFP4
block scales from 0.98 to 0.60 of max|block| / 6, each rounded to fp8 as stored, and MXFP4
exponents one above and one below the OCP one.
"""

from __future__ import annotations

import torch

from kiln.quant.formats import StoredTensor, WeightFormat, grouped, register_format, ungrouped
from kiln.quant.packing import (
    E2M1_MAX,
    FP8_E4M3_MAX,
    e2m1_decode,
    e2m1_encode,
    e8m0_decode,
    e8m0_encode_floor,
    fp8_e4m3_decode,
    safe_divisor,
    to_fp8_e4m3,
)


def e2m1_codes(w: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
    """Values [o, cols] / scale [o, B, 1] (B = ceil(cols/block)) -> E2M1 codes uint8 [o, cols]."""
    codes = e2m1_encode(grouped(w, block) / scale)  # saturates at +-6
    return ungrouped(codes, w.shape[1])


def scale_e2m1(codes: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
    """E2M1 codes uint8 [o, cols] times scale [o, B, 1] -> float32 [o, cols]."""
    values = e2m1_decode(codes)  # [o, cols]
    return ungrouped(grouped(values, block) * scale, values.shape[1])


class NvFp4Format(WeightFormat):
    """NVIDIA's NVFP4: E2M1 values, an fp8 E4M3 scale per 16, an fp32 global scale."""

    name = "nvfp4"
    group_size = 16
    packs_nibbles = True
    shrinks = tuple(1 - 0.02 * k for k in range(1, 21))  # 0.98 .. 0.60; fp8 merges neighbours

    def storage(self, out_features, in_features):
        return [StoredTensor("weight_packed", torch.uint8, in_features // 2),
                StoredTensor("weight_scale", torch.float8_e4m3fn, self.groups(in_features)),
                StoredTensor("weight_global_scale", torch.float32, None)]

    @staticmethod
    def global_scale(amax: torch.Tensor) -> torch.Tensor:
        """The divisor g that maps max|W| onto the largest fp8 scale times the largest E2M1."""
        amax = amax.float()
        return torch.where(amax > 0, FP8_E4M3_MAX * E2M1_MAX / safe_divisor(amax), 1.0)

    def params(self, w, shrink=1.0, global_scale: torch.Tensor | None = None):
        """W [o, cols] -> block scales [o, B] and the global scale: `global_scale` ([1], or
        [o] / [o, 1] per row), default one scalar for all of W (from the unshrunk max|W|)."""
        w = w.float()
        g = self.global_scale(w.abs().amax()) if global_scale is None else global_scale
        g = g.float().reshape(-1, 1, 1)  # broadcasts as one scalar, or one per row
        amax = grouped(w, 16).abs().amax(dim=2, keepdim=True) * shrink  # [o, B, 1]
        return {"weight_scale": to_fp8_e4m3(amax / E2M1_MAX * g).squeeze(2),  # [o, B]
                "weight_global_scale": g.reshape(-1)}                          # [1] or [o]

    def codes(self, w, params):
        return e2m1_codes(w, safe_divisor(self._block_scale(params)), 16)

    def decode(self, codes, params):
        return scale_e2m1(codes, self._block_scale(params), 16)

    @staticmethod
    def _block_scale(params) -> torch.Tensor:
        """[o, B, 1] effective scale of each block: fp8 block scale / global scale."""
        g = params["weight_global_scale"].float().reshape(-1, 1, 1)  # [1 | o, 1, 1]
        return fp8_e4m3_decode(params["weight_scale"]).unsqueeze(2) / g

    def fake_quantize(self, x):
        """Per-token: each row of x [rows, in] gets its own global scale (dynamic, batch-invariant)."""
        g = self.global_scale(x.abs().amax(dim=1, keepdim=True))  # [rows, 1]
        return self.snap(x, self.params(x, global_scale=g)).to(x.dtype)


class MxFp4Format(WeightFormat):
    """OCP MXFP4: E2M1 values with an E8M0 (power-of-two) scale per 32."""

    name = "mxfp4"
    group_size = 32
    packs_nibbles = True
    shrinks = (2.0, 0.5)  # the exponents either side of the OCP one

    def storage(self, out_features, in_features):
        return [StoredTensor("weight_packed", torch.uint8, in_features // 2),
                StoredTensor("weight_scale", torch.uint8, self.groups(in_features))]

    def params(self, w, shrink=1.0):
        amax = grouped(w.float(), 32).abs().amax(dim=2) * shrink  # [o, B]
        return {"weight_scale": e8m0_encode_floor(amax, elem_emax=2)}

    def codes(self, w, params):
        return e2m1_codes(w, e8m0_decode(params["weight_scale"]).unsqueeze(2), 32)

    def decode(self, codes, params):
        return scale_e2m1(codes, e8m0_decode(params["weight_scale"]).unsqueeze(2), 32)


register_format(NvFp4Format())
register_format(MxFp4Format())
