"""Weight-only int8/fp8 GEMV (kiln.kernels.triton.quant_gemv) against its torch reference, on
weights quantized by kiln's own formats."""

from __future__ import annotations

import pytest
import torch

from kiln.kernels.triton import reference
from kiln.kernels.triton.quant_gemv import weight_only_gemv
from tests.kernels.triton.common import DEVICES, DTYPES, close


def quantized(format_name: str, out_features: int, in_features: int) -> dict[str, torch.Tensor]:
    from kiln.quant.formats import get_format

    fmt = get_format(format_name)
    w = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(0))
    return fmt.quantize(w, fmt.params(w))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", ["int8", "fp8"])
@pytest.mark.parametrize("shape", [(1, 20, 48), (3, 40, 70), (17, 24, 40), (0, 20, 48)],
                         ids=["m1", "m3-partial", "m17-two-row-tiles", "m0-empty"])
def test_gemv_matches_reference(device, dtype, fmt, shape):
    rows, cols, inner = shape
    packed = {k: t.to(device) for k, t in quantized(fmt, cols, inner).items()}
    x = (torch.randn(rows, inner, generator=torch.Generator().manual_seed(1)) / inner ** 0.5)
    x = x.to(dtype).to(device)
    got = weight_only_gemv(x, packed["weight"], packed["weight_scale"])
    close(got, reference.weight_only_gemv(x, packed["weight"], packed["weight_scale"]), dtype)


def test_bad_weight_dtype_is_named():
    with pytest.raises(ValueError, match="weight is torch.float32; expected int8"):
        weight_only_gemv(torch.zeros(1, 4), torch.zeros(2, 4), torch.ones(2, 1))
