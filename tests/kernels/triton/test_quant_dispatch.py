"""The int8/fp8 weight-only linears (kiln.quant.linear) on the Triton kernel set: steps of at
most quant_gemv.MAX_ROWS rows go through the Triton GEMV (counted through a wrapper that calls
the real kernel, and equal to the kernel's own output bit for bit), larger ones and other
kernel sets do not. An engine on it: tests/engine/test_triton_features.py."""

from __future__ import annotations

import pytest
import torch

from kiln.kernels.triton import quant_gemv
from kiln.models.layers.linear import Linear, get_linear_method, use_kernels
from kiln.platform import KernelSet
from tests.kernels.triton.common import DEVICES, DTYPES, close


@pytest.fixture
def gemv_calls(monkeypatch) -> list[int]:
    """Rows of each call to the real quant_gemv.weight_only_gemv, recorded on the way in."""
    calls: list[int] = []
    real = quant_gemv.weight_only_gemv

    def counted(x, weight, scale, out=None):
        calls.append(x.shape[0])
        return real(x, weight, scale, out)

    monkeypatch.setattr(quant_gemv, "weight_only_gemv", counted)
    return calls


def quantized_linear(fmt: str, out_features: int, in_features: int, bias: bool = False
                     ) -> Linear:
    import kiln.quant.linear  # noqa: F401  (registers the quantized formats)

    gen = torch.Generator().manual_seed(0)
    layer = Linear(in_features, [out_features - 8, 8], bias=bias, method=get_linear_method(fmt))
    for shard, rows in enumerate(layer.out_shards):
        layer.method.load_shard(layer, shard, "weight", torch.randn(rows, in_features,
                                                                      generator=gen))
        if bias:
            layer.method.load_shard(layer, shard, "bias", torch.randn(rows, generator=gen))
    layer.method.finalize(layer)
    return layer


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_small_steps_take_the_triton_gemv(device, dtype, fmt, gemv_calls):
    layer = quantized_linear(fmt, 40, 48, bias=True).to(device)
    use_kernels(layer, KernelSet.TRITON)
    x = torch.randn(quant_gemv.MAX_ROWS, 48, generator=torch.Generator().manual_seed(1)) / 7
    x = x.to(dtype).to(device)
    reference = layer.method.dequantized_matmul(layer, x) + layer.bias.to(dtype)
    for rows in (1, 3, quant_gemv.MAX_ROWS):
        got = layer(x[:rows])
        kernel = quant_gemv.weight_only_gemv(x[:rows], layer.weight, layer.weight_scale)
        assert torch.equal(got, kernel + layer.bias.to(dtype))
        close(got, reference[:rows], dtype)
    assert gemv_calls == [1, 1, 3, 3, quant_gemv.MAX_ROWS, quant_gemv.MAX_ROWS]
    fp32 = layer.method.apply_fp32(layer, x[:2])  # the LM head's fp32 logits, too
    assert fp32.dtype == torch.float32 and gemv_calls[-1] == 2


@pytest.mark.parametrize("device", DEVICES)
def test_large_steps_and_other_kernel_sets_do_not(device, gemv_calls):
    x = torch.randn(quant_gemv.MAX_ROWS + 1, 48, generator=torch.Generator().manual_seed(1))
    x = x.to(device)
    for fmt, kernels in (("int8", KernelSet.TRITON), ("fp8", KernelSet.TRITON),
                         ("int8", KernelSet.TORCH), ("int8-dyn", KernelSet.TRITON),
                         ("int4-g32-sym", KernelSet.TRITON)):
        layer = quantized_linear(fmt, 40, 48).to(device)
        use_kernels(layer, kernels)
        assert layer(x).shape == (quant_gemv.MAX_ROWS + 1, 40)
        assert layer(x[:2]).shape == (2, 40)
        expected = 1 if kernels is KernelSet.TRITON and fmt in ("int8", "fp8") else 0
        assert len(gemv_calls) == expected, (fmt, kernels)
        gemv_calls.clear()
