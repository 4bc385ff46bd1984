"""Quantized linear methods behind the Linear seam: loading, fused shards, compute."""

import pytest
import torch
import torch.nn.functional as F

from kiln.kernels.quant_mm import INT8_WEIGHT_ONLY_MAX_TOKENS, int8_weight_only_mm
from kiln.models.layers.linear import Linear, available_linear_methods, get_linear_method
from kiln.quant import get_format

IN = 128
SHARDS = [32, 16, 16]  # fused q/k/v-like output rows
NAMES = ["int8", "fp8", "int4-g32-asym", "int4-g64-sym", "int4-g128-sym", "nvfp4", "mxfp4"]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def assert_close_to_scale(y: torch.Tensor, ref: torch.Tensor, rel: float) -> None:
    """Max error within `rel` of the output's scale: fp32 sums of large terms can land near 0."""
    assert (y - ref).abs().max() <= rel * ref.abs().max()


def shard_weights(seed: int = 0, scales=(1.0, 30.0, 0.01)) -> list[torch.Tensor]:
    """One float weight per shard, at very different magnitudes (distinct global scales)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(rows, IN, generator=g) * s for rows, s in zip(SHARDS, scales, strict=True)]


def build(name: str, weights: list[torch.Tensor], bias: bool = True, **kwargs) -> Linear:
    method = get_linear_method(name)
    for key, value in kwargs.items():
        setattr(method, key, value)
    layer = Linear(weights[0].shape[1], [w.shape[0] for w in weights], bias=bias, method=method)
    for shard, w in enumerate(weights):
        method.load_shard(layer, shard, "weight", w)
        if bias:
            method.load_shard(layer, shard, "bias", torch.arange(w.shape[0]) / 10.0)
    method.finalize(layer)
    return layer


def codes(layer: Linear) -> torch.Tensor:
    """An int8 layer's codes [out, in] (kept VNNI-packed where the CPU has AVX512-VNNI)."""
    return layer.method.stored(layer, "weight")


def reference(layer: Linear, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, layer.method.dequantize_weight(layer).to(x.dtype), layer.bias)


def test_every_format_has_a_method_and_a_dynamic_twin():
    names = set(available_linear_methods())
    for name in [*NAMES, "int4"]:
        assert {name, f"{name}-dyn"} <= names


@pytest.mark.parametrize("name", NAMES)
def test_matches_dequantized_reference_matmul(name):
    layer = build(name, shard_weights())
    x = torch.randn(2, 5, IN)
    y = layer(x)
    assert y.shape == (2, 5, sum(SHARDS)) and y.dtype == torch.float32
    if not hasattr(layer, "int8_vnni_weight"):
        torch.testing.assert_close(y, reference(layer, x), rtol=1e-6, atol=1e-6)
        return
    # kiln's VNNI int8 kernel holds each token's activations as 22-bit fixed point with a
    # power-of-two step s <= max|x| / 2^21 (decision 0017): per output the error is at most
    # scale[n] * s / 2 * sum_k |w[n, k]|, plus fp32 rounding
    ref = reference(layer, x)
    step = x.abs().amax(dim=-1, keepdim=True) / 2**21
    bound = step / 2 * (codes(layer).float().abs().sum(1) * layer.weight_scale.reshape(-1))
    assert ((y - ref).abs() <= bound + 1e-6 * ref.abs() + 1e-7).all()


@pytest.mark.parametrize("name", NAMES)
def test_float_weights_are_quantized_per_shard_on_load(name):
    weights = shard_weights()
    layer = build(name, weights)
    expected = torch.cat([get_format(name).dequantize(get_format(name).quantize(w))
                          for w in weights])
    assert torch.equal(layer.method.dequantize_weight(layer), expected)


@pytest.mark.parametrize("name", NAMES)
def test_prepacked_tensors_load_into_shard_rows(name):
    """A quantized checkpoint (per-shard stored tensors) loads to the same layer as float."""
    fmt, weights = get_format(name), shard_weights(seed=1)
    dense = build(name, weights, bias=False)
    method = get_linear_method(name)
    packed = Linear(IN, SHARDS, method=method)
    for shard, w in enumerate(weights):
        for tensor_name, tensor in fmt.quantize(w).items():
            method.load_shard(packed, shard, tensor_name, tensor)
    method.finalize(packed)
    assert torch.equal(method.dequantize_weight(packed), dense.method.dequantize_weight(dense))
    for shard in range(len(SHARDS)):
        for key, value in dense.method.shard_tensors(dense, shard).items():
            assert torch.equal(value, method.shard_tensors(packed, shard)[key])


def test_per_tensor_fp8_scales_broadcast_to_their_shard():
    """FP8 checkpoints often hold one scale per tensor; fused shards keep theirs apart."""
    method = get_linear_method("fp8")
    layer = Linear(IN, SHARDS, method=method)
    codes = [torch.randn(rows, IN).to(torch.float8_e4m3fn) for rows in SHARDS]
    for shard, (q, scale) in enumerate(zip(codes, (0.5, 2.0, 0.25), strict=True)):
        method.load_shard(layer, shard, "weight", q)
        method.load_shard(layer, shard, "weight_scale", torch.tensor(scale, dtype=torch.bfloat16))
    method.finalize(layer)
    expected = torch.cat([q.float() * s for q, s in zip(codes, (0.5, 2.0, 0.25), strict=True)])
    assert torch.equal(method.dequantize_weight(layer), expected)


def test_nvfp4_keeps_one_global_scale_per_shard():
    weights = shard_weights()
    layer = build("nvfp4", weights)
    per_shard = [get_format("nvfp4").quantize(w)["weight_global_scale"] for w in weights]
    assert torch.equal(layer.weight_global_scale, torch.cat(per_shard))
    assert len(set(layer.weight_global_scale.tolist())) == 3  # the shards really differ
    deq = layer.method.dequantize_weight(layer)
    for w, part in zip(weights, deq.split(SHARDS), strict=True):
        assert ((part - w).norm() / w.norm()) < 0.12  # each shard keeps its own precision


@pytest.mark.parametrize("name", ["int8", "nvfp4", "int4-g32-asym"])
def test_shard_tensors_reload_to_identical_outputs(name):
    source = build(name, shard_weights(seed=2))
    method = get_linear_method(name)
    copy = Linear(IN, SHARDS, bias=True, method=method)
    for shard in range(len(SHARDS)):
        for tensor_name, tensor in source.method.shard_tensors(source, shard).items():
            method.load_shard(copy, shard, tensor_name, tensor)
    method.finalize(copy)
    x = torch.randn(3, IN)
    assert torch.equal(copy(x), source(x))


@pytest.mark.parametrize("name", NAMES)
def test_bf16_activations(name):
    layer = build(name, shard_weights())
    x = torch.randn(4, IN).bfloat16()
    y = layer(x)
    assert y.dtype == torch.bfloat16
    ref = reference(layer, x.float())
    assert (y.float() - ref).norm() / ref.norm() < 1e-2


@pytest.mark.parametrize("tokens", [1, INT8_WEIGHT_ONLY_MAX_TOKENS])
def test_int8_kernel_matches_reference_in_bf16(tokens):
    layer = build("int8", shard_weights(), bias=False)
    x = torch.randn(tokens, IN).bfloat16()
    y = int8_weight_only_mm(x, codes(layer), layer.weight_scale)
    assert y is not None and y.dtype == torch.bfloat16
    ref = reference(layer, x.float())
    assert_close_to_scale(y.float(), ref, rel=1e-2)  # bf16 scales and output


def test_int8_kernel_declines_fp32_and_large_batches():
    layer = build("int8", shard_weights(), bias=False)
    assert int8_weight_only_mm(torch.randn(1, IN), codes(layer), layer.weight_scale) is None
    big = torch.randn(INT8_WEIGHT_ONLY_MAX_TOKENS + 1, IN).bfloat16()
    assert int8_weight_only_mm(big, codes(layer), layer.weight_scale) is None


def test_many_bf16_tokens_multiply_in_fp32_where_bf16_matmul_is_emulated(monkeypatch):
    """Past the int8 kernels' token counts, bf16 steps on CPUs without bf16 arithmetic (AVX2)
    multiply the dequantized fp32 weights in fp32 and round once; elsewhere they keep the
    bf16 reference."""
    from kiln.quant import linear as quant_linear

    monkeypatch.setenv("KILN_INT8_VNNI", "0")  # the plain rows' routing on every CPU
    layer = build("int8", shard_weights(), bias=False)
    x = torch.randn(INT8_WEIGHT_ONLY_MAX_TOKENS + 5, IN).bfloat16()
    exact = F.linear(x.float(), layer.method.dequantize_weight(layer))
    for emulated in (True, False):
        monkeypatch.setattr(quant_linear, "bf16_matmul_emulated", lambda e=emulated: e)
        y = layer(x)
        assert y.dtype == torch.bfloat16
        if emulated:  # fp32 sums rounded once: each output within half a bf16 step
            assert ((y.float() - exact).abs() <= exact.abs() * 2.0 ** -8 + 1e-6).all()
        else:
            assert torch.equal(y, reference(layer, x))


def test_row_tiles_give_the_same_result():
    weights = shard_weights()
    whole, tiled = build("nvfp4", weights), build("nvfp4", weights, tile_elements=IN * 7)
    assert len(list(tiled.method.row_tiles(tiled))) == 10  # 64 rows in tiles of 7
    x = torch.randn(3, IN)
    assert_close_to_scale(tiled(x), whole(x), rel=1e-6)


@pytest.mark.parametrize("name", ["int8", "fp8", "int4-g32-sym", "nvfp4", "mxfp4"])
def test_dynamic_activation_quantization_matches_fake_quant_reference(name):
    layer = build(f"{name}-dyn", shard_weights())
    x = torch.randn(6, IN)
    ref = reference(layer, get_format(name).fake_quantize(x))
    assert_close_to_scale(layer(x), ref, rel=1e-6)
    assert not torch.equal(layer(x), reference(layer, x))  # activations really were quantized


def test_w8a8_accumulates_exactly_in_int32():
    layer = build("int8-dyn", shard_weights(), bias=False)
    x = torch.randn(5, IN)
    xq = get_format("int8").quantize(x)
    exact = (xq["weight"].double() @ layer.weight.double().T) * xq["weight_scale"].double() \
        * layer.weight_scale.double().T
    torch.testing.assert_close(layer(x).double(), exact, rtol=1e-6, atol=1e-6)


def test_missing_tensors_fail_at_finalize():
    method = get_linear_method("nvfp4")
    layer = Linear(IN, SHARDS, method=method)
    fmt = get_format("nvfp4")
    for name, tensor in fmt.quantize(torch.randn(SHARDS[0], IN)).items():
        if name != "weight_global_scale":
            method.load_shard(layer, 0, name, tensor)
    with pytest.raises(ValueError, match="shard 0: weight_global_scale"):
        method.finalize(layer)


@pytest.mark.parametrize(("name", "tensor_name", "tensor", "match"), [
    ("int4-g32-sym", "weight_packed", torch.zeros(SHARDS[0], IN // 8, dtype=torch.int32), "shape"),
    ("int4-g32-sym", "weight_packed", torch.zeros(SHARDS[0], IN // 2, dtype=torch.int8), "dtype"),
    ("int8", "weight_zero_point", torch.zeros(SHARDS[0], 1), "no tensor"),
    ("int8", "weight", torch.zeros(SHARDS[0] + 1, IN), "shape"),
])
def test_bad_checkpoint_tensors_are_rejected(name, tensor_name, tensor, match):
    method = get_linear_method(name)
    layer = Linear(IN, SHARDS, method=method)
    with pytest.raises(ValueError, match=match):
        method.load_shard(layer, 0, tensor_name, tensor)


def test_odd_in_features_cannot_pack_nibbles():
    with pytest.raises(ValueError, match="odd number of inputs"):
        Linear(97, 8, method=get_linear_method("int4-g128-sym"))


@pytest.mark.parametrize("name", ["int4-g128-sym", "int4-g128-asym", "nvfp4", "mxfp4"])
def test_short_last_group(name):
    """576 inputs (the default model's hidden size) = 4 groups of 128 and one of 64."""
    w = torch.randn(8, 576)
    layer = build(name, [w], bias=False)
    x = torch.randn(3, 576)
    torch.testing.assert_close(layer(x), reference(layer, x), rtol=1e-6, atol=1e-6)
    assert (layer.method.dequantize_weight(layer) - w).norm() / w.norm() < 0.13
