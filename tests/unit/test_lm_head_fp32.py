"""Every linear method's `apply_fp32` (the LM head's logits): fp32 outputs from fp32 sums, never
rounded to the model dtype; and the loader gives the LM head a method that writes them cheaply."""

from __future__ import annotations

import pytest
import torch

import kiln.models.layers.cpu_bf16  # noqa: F401  (registers dense-bf16-fp32)
import kiln.models.layers.onednn  # noqa: F401  (registers dense-onednn)
import kiln.models.layers.vnni  # noqa: F401  (registers dense-vnni)
import kiln.quant  # noqa: F401  (registers the quantized formats)
from kiln.kernels import cpu as cpu_kernels
from kiln.kernels.bf16_mm import onednn_available
from kiln.kernels.bf16_vnni import vnni_available
from kiln.models.layers.linear import Linear, get_linear_method

K, N = 96, 300


def layer(name: str, weight: torch.Tensor) -> Linear:
    method = get_linear_method(name)
    lin = Linear(K, N, dtype=torch.bfloat16, method=method)
    method.load_shard(lin, 0, "weight", weight)
    method.finalize(lin)
    return lin


def methods() -> list[str]:
    names = ["dense", "int8", "int8-dyn", "int4"]
    if cpu_kernels.load():
        names.append("dense-bf16-fp32")
    if onednn_available(torch.bfloat16):
        names.append("dense-onednn")
    if vnni_available():
        names.append("dense-vnni")
    return names


@pytest.mark.parametrize("name", methods())
@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_apply_fp32_is_the_methods_product_unrounded(name, tokens):
    g = torch.Generator().manual_seed(tokens)
    weight = torch.randn(N, K, generator=g).bfloat16()
    lin = layer(name, weight)
    x = torch.randn(tokens, K, generator=g).bfloat16()
    y = lin.method.apply_fp32(lin, x)
    assert y.dtype == torch.float32 and y.shape == (tokens, N)
    # not itself bf16-rounded (almost every fp32 sum has bits below bf16's)
    assert (y != y.bfloat16().float()).float().mean() > 0.9
    if name.endswith("-dyn"):  # W8A8: activations quantized per token, as `apply` does
        rounded = lin.method.apply(lin, x).float()
        assert ((y - rounded).abs() <= 2.0 ** -8 * rounded.abs() + 1e-3).all()
        return
    # weight-only: x times the (dequantized) weight, in fp32 arithmetic
    w = weight if name.startswith("dense") else lin.method.dequantize_weight(lin)
    exact = x.double() @ w.double().t()
    assert ((y.double() - exact).abs() <= 1e-5 * (x.double().abs() @ w.double().abs().t())).all()


def test_the_lm_head_is_never_onednn_packed():
    """oneDNN's bf16 linear cannot write fp32: the LM head keeps plain weights beside it."""
    from kiln.models.loader import _method_chooser

    method_for = _method_chooser({}, None, "dense-onednn")
    assert type(method_for("model.layers.0.mlp.down_proj")).__name__ == "OneDNNLinearMethod"
    assert type(method_for("lm_head")).__name__ in ("CpuBf16LinearMethod", "DenseLinearMethod")


def test_a_vnni_packed_model_packs_its_lm_head_too():
    """kiln's VNNI kernel writes fp32 logits itself, so the head streams the packed layout
    (whatever its vocabulary: `dense-vnni-head`)."""
    from kiln.models.layers.vnni import VnniLinearMethod
    from kiln.models.loader import _method_chooser

    method_for = _method_chooser({}, None, "dense-vnni")
    head = method_for("lm_head")
    assert type(head).__name__ == "VnniHeadMethod" and isinstance(head, VnniLinearMethod)
    assert head.any_rows and not method_for("model.layers.0.mlp.down_proj").any_rows
