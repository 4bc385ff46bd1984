"""Speed paths for quantized matmuls, beside the plain dequantize-then-matmul reference.

Each function returns None when its kernel cannot run (old torch, a device or dtype it does not
take), and the caller falls back to the reference path in kiln.quant.linear. GPU kernels go
here too, each tested against that reference.
"""

from __future__ import annotations

import torch

# When torch's int8 weight-only kernel pays off on CPU (measured on 576x1536 and 1536x576,
# one thread, torch 2.13): with bf16 activations it is 3-10x faster than dequantize + matmul
# up to ~32 tokens (and ~3x faster than a dense bf16 matmul at one token), but ~2x slower at
# 128 tokens; its fp32 path is 3-50x slower than dequantize + fp32 matmul at any size.
INT8_WEIGHT_ONLY_DTYPES = (torch.bfloat16, torch.float16)
INT8_WEIGHT_ONLY_MAX_TOKENS = 32


def int8_weight_only_mm(x: torch.Tensor, weight: torch.Tensor,
                        scale: torch.Tensor) -> torch.Tensor | None:
    """x [M, K] float @ (weight int8 [N, K] * scale [N, 1])^T -> [M, N] in x's dtype."""
    if (not hasattr(torch, "_weight_int8pack_mm") or x.device.type != "cpu"
            or x.dtype not in INT8_WEIGHT_ONLY_DTYPES or x.shape[0] > INT8_WEIGHT_ONLY_MAX_TOKENS):
        return None
    return torch._weight_int8pack_mm(x.contiguous(), weight, scale.reshape(-1).to(x.dtype))


def int8_int8_mm(xq: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """xq int8 [M, K] @ weight int8 [N, K]^T -> exact int32 [M, N] (W8A8 accumulation)."""
    if not hasattr(torch, "_int_mm") or xq.device.type != "cpu":
        return None
    return torch._int_mm(xq.contiguous(), weight.t())
