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
    pack_nibbles,
    safe_divisor,
    to_fp8_e4m3,
    unpack_nibbles,
)


def pack_e2m1(blocks: torch.Tensor, scale: torch.Tensor, in_features: int) -> torch.Tensor:
    """Values [o, B, b] / scale [o, B, 1] -> packed E2M1 codes uint8 [o, in/2]."""
    codes = e2m1_encode(blocks / scale)  # saturates at +-6
    return pack_nibbles(ungrouped(codes, in_features))


def scale_e2m1(packed: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
    """Packed codes uint8 [o, in/2] times scale [o, B, 1] (B = ceil(in/block)) -> float32 [o, in]."""
    values = e2m1_decode(unpack_nibbles(packed))  # [o, in]
    return ungrouped(grouped(values, block) * scale, values.shape[1])


class NvFp4Format(WeightFormat):
    """NVIDIA's NVFP4: E2M1 values, an fp8 E4M3 scale per 16, an fp32 global scale."""

    name = "nvfp4"
    group_size = 16
    packs_nibbles = True

    def storage(self, out_features, in_features):
        return [StoredTensor("weight_packed", torch.uint8, in_features // 2),
                StoredTensor("weight_scale", torch.float8_e4m3fn, self.groups(in_features)),
                StoredTensor("weight_global_scale", torch.float32, None)]

    @staticmethod
    def global_scale(amax: torch.Tensor) -> torch.Tensor:
        """The divisor g that maps max|W| onto the largest fp8 scale times the largest E2M1."""
        amax = amax.float()
        return torch.where(amax > 0, FP8_E4M3_MAX * E2M1_MAX / safe_divisor(amax), 1.0)

    def quantize(self, w, global_scale: torch.Tensor | None = None):
        """W [o, i] -> packed; `global_scale` ([1], or [o] / [o, 1] per row) defaults to one
        scalar for all of W."""
        w = w.float()
        g = self.global_scale(w.abs().amax()) if global_scale is None else global_scale
        g = g.reshape(-1, 1, 1)  # broadcasts as one scalar, or one per row
        blocks = grouped(w, 16)  # [o, B, 16]
        block_scale = to_fp8_e4m3(blocks.abs().amax(dim=2, keepdim=True) / E2M1_MAX * g)
        effective = safe_divisor(fp8_e4m3_decode(block_scale) / g)  # [o, B, 1]
        return {"weight_packed": pack_e2m1(blocks, effective, w.shape[1]),  # [o, i/2]
                "weight_scale": block_scale.squeeze(2),                     # [o, B]
                "weight_global_scale": g.reshape(-1)}                        # [1] or [o]

    def dequantize(self, packed):
        g = packed["weight_global_scale"].float().reshape(-1, 1, 1)         # [1 | o, 1, 1]
        scale = fp8_e4m3_decode(packed["weight_scale"]).unsqueeze(2) / g    # [o, B, 1]
        return scale_e2m1(packed["weight_packed"], scale, 16)

    def fake_quantize(self, x):
        """Per-token: each row of x [rows, in] gets its own global scale (dynamic, batch-invariant)."""
        g = self.global_scale(x.abs().amax(dim=1, keepdim=True))  # [rows, 1]
        return self.dequantize(self.quantize(x, global_scale=g)).to(x.dtype)


class MxFp4Format(WeightFormat):
    """OCP MXFP4: E2M1 values with an E8M0 (power-of-two) scale per 32."""

    name = "mxfp4"
    group_size = 32
    packs_nibbles = True

    def storage(self, out_features, in_features):
        return [StoredTensor("weight_packed", torch.uint8, in_features // 2),
                StoredTensor("weight_scale", torch.uint8, self.groups(in_features))]

    def quantize(self, w):
        blocks = grouped(w.float(), 32)  # [o, B, 32]
        exponent = e8m0_encode_floor(blocks.abs().amax(dim=2, keepdim=True), elem_emax=2)
        return {"weight_packed": pack_e2m1(blocks, e8m0_decode(exponent), w.shape[1]),  # [o, i/2]
                "weight_scale": exponent.squeeze(2)}                                     # [o, B]

    def dequantize(self, packed):
        scale = e8m0_decode(packed["weight_scale"]).unsqueeze(2)  # [o, B, 1]
        return scale_e2m1(packed["weight_packed"], scale, 32)


register_format(NvFp4Format())
register_format(MxFp4Format())
