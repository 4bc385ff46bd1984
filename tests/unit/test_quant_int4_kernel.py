"""int4 layers on torch's CPU int4 kernel: the repack keeps the stored tensors, the kernel path
matches the reference dequantize path, and layers fall back (with a log line) where the kernel
cannot run (the kernel's layout itself: tests/kernels/test_quant_mm.py)."""

import logging

import pytest
import torch
import torch.nn.functional as F

from kiln.kernels.quant_mm import INT4_KERNEL_MAX_TOKENS, int4_kernel_unavailable
from kiln.models.layers.linear import Linear, get_linear_method

INT4 = [f"int4-g{g}-{s}" for g in (32, 64, 128) for s in ("sym", "asym")]
needs_kernel = pytest.mark.skipif(int4_kernel_unavailable(torch.bfloat16) is not None,
                                  reason="torch's CPU int4 kernel is not usable here")


def build(name: str, shards: list[int], in_features: int, dtype=torch.bfloat16,
          seed: int = 0) -> tuple[Linear, torch.Tensor]:
    """A layer loaded from float weights; also returns its weight_packed before finalize."""
    g = torch.Generator().manual_seed(seed)
    method = get_linear_method(name)
    layer = Linear(in_features, shards, dtype=dtype, method=method)
    for shard, rows in enumerate(shards):
        method.load_shard(layer, shard, "weight", torch.randn(rows, in_features, generator=g))
    packed = layer.weight_packed.clone()
    method.finalize(layer)
    return layer, packed


@needs_kernel
@pytest.mark.parametrize("name", INT4)
def test_repacked_layer_keeps_its_stored_tensors(name):
    layer, packed = build(name, [48, 16, 16], 192)
    assert hasattr(layer, "int4_kernel_weight") and not hasattr(layer, "weight_packed")
    assert torch.equal(layer.method.stored(layer, "weight_packed"), packed)
    plain, _ = build(name, [48, 16, 16], 192, dtype=torch.float32)  # never repacked
    for shard in range(3):
        ours, theirs = layer.method.shard_tensors(layer, shard), plain.method.shard_tensors(
            plain, shard)
        assert ours.keys() == theirs.keys()
        assert all(torch.equal(ours[k], theirs[k]) for k in ours)


@needs_kernel
@pytest.mark.parametrize("name", INT4)
@pytest.mark.parametrize("tokens", [1, 5, INT4_KERNEL_MAX_TOKENS])
def test_kernel_path_matches_the_reference(name, tokens):
    layer, _ = build(name, [96, 32], 576)
    x = torch.randn(tokens, 576).bfloat16()
    ref = F.linear(x.float(), layer.method.dequantize_weight(layer))
    y = layer(x).float()
    # bf16 scales (8 mantissa bits to fp16's 11) and bf16 outputs: ~0.5% of the output scale
    assert (y - ref).abs().max() <= 0.01 * ref.abs().max()


@needs_kernel
def test_many_tokens_take_the_reference_path_exactly():
    layer, _ = build("int4-g64-asym", [64], 128)
    x = torch.randn(INT4_KERNEL_MAX_TOKENS + 1, 128).bfloat16()
    expected = F.linear(x, layer.method.dequantize_weight(layer).bfloat16())
    assert torch.equal(layer(x), expected)


def test_fp32_layers_fall_back_and_say_so(caplog):
    from kiln.quant import linear

    linear._LOGGED.clear()
    with caplog.at_level(logging.INFO, logger="kiln.quant.linear"):
        layer, packed = build("int4-g32-sym", [32], 64, dtype=torch.float32)
    assert torch.equal(layer.weight_packed, packed) and not hasattr(layer, "int4_kernel_weight")
    assert "reference dequantize path" in caplog.text
    x = torch.randn(3, 64)
    torch.testing.assert_close(layer(x), F.linear(x, layer.method.dequantize_weight(layer)))


def test_shapes_the_kernel_cannot_take_fall_back():
    layer, packed = build("int4-g32-sym", [24], 64)  # 24 output rows: not a multiple of 16
    assert torch.equal(layer.weight_packed, packed) and not hasattr(layer, "int4_kernel_weight")
