"""gemm_int8_vnni.cpp: weight-only int8 on AVX512-VNNI digit dot products (`int8_vnni_mm`)
against an fp64 matmul of the dequantized weights and against kiln's fp32 int8 kernel
(`int8_gemv`); the packing round trip; batch invariance; the linear method that packs at
finalize; and a tiny int8 Llama giving the same greedy tokens through the new kernel (inside
the fused stack) as through the old one. From `int8_wide_min_tokens` bf16 tokens on, the codes
are widened to bf16 and summed in fp32 (decision 0025): checked against the same fp64 matmul
within fp32 summation's bound, batch-invariant among such steps, and routed so that long bf16
prefill steps never dequantize.

The error bound (gemm_int8_vnni.cpp's header): per token, activations become x_q = round(x / s)
with s = 2^(e - 22), max|x| < 2^e, and the integer sum is exact, so
    |y[m, n] - ref[m, n]| <= scale[n] * s_m / 2 * sum_k |w[n, k]|
plus the output's rounding (fp32: 2^-24 relative; bf16: 2^-9). Against the fp32-summing
int8_gemv the RMS error is smaller on Gaussian bf16 activations (exact fixed point but for the
smallest elements) and up to ~15x larger on fp32 activations spanning five decades
(test_error_within_a_factor_of_the_fp32_kernel states each factor); it stays below 2^-11 of a
token's mean output magnitude, a quarter of a bf16 output's rounding step.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

from kiln.kernels.int8_vnni import (
    int8_vnni_available,
    int8_vnni_calls,
    int8_vnni_mm,
    pack_int8_vnni,
    unpack_int8_vnni,
)
from kiln.quant.gptq import single_thread
from tests.kernels.common import needs_cpu_kernels

pytestmark = needs_cpu_kernels
needs_vnni = pytest.mark.skipif(not int8_vnni_available(), reason="no AVX512-VNNI on this CPU")

# (K, N): the default model's qkv and down projections, K and N off the quad and the block,
# one input, one output row short of a block, a panel and a bit
SHAPES = [(576, 960), (1536, 576), (33, 40), (7, 5), (1, 3), (64, 80)]
TOKENS = [1, 2, 3, 4, 5, 6, 7, 8, 13, 24]  # from 8 a panel fetches the next one ahead


def int8_layer(k: int, n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes [N, K] over the whole int8 range (-128 included) and scales [N, 1] over 1e-3..1."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    return w, torch.logspace(-3, 0, n).reshape(n, 1)


def wide_activations(m: int, k: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    """Magnitudes spread over ~5 decades (log-normal) with 1% outliers 100x larger."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.exp(2 * torch.randn(m, k, generator=g))
    outliers = torch.rand(m, k, generator=g) < 0.01
    return (x * torch.where(outliers, 100.0, 1.0)).to(dtype)


def reference(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x.double() @ (w.double() * scale.double().reshape(-1, 1)).T


def fixed_point_bound(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """scale[n] * s_m / 2 * sum_k |w[n, k]| per output [M, N]."""
    amax = x.double().abs().amax(dim=1, keepdim=True)
    s = torch.tensor([math.ldexp(1.0, math.frexp(a)[1] - 22) for a in amax.flatten().tolist()],
                     dtype=torch.float64).reshape(-1, 1)
    return s / 2 * (w.double().abs().sum(dim=1) * scale.double().flatten()).reshape(1, -1)


def check(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, fp32_out: bool) -> torch.Tensor:
    y = int8_vnni_mm(x, pack_int8_vnni(w), scale, w.shape[0], fp32_out)
    assert y.shape == (x.shape[0], w.shape[0])
    assert y.dtype == (torch.float32 if fp32_out else x.dtype)
    ref = reference(x, w, scale)
    rounding = 2.0 ** -23 if y.dtype == torch.float32 else 2.0 ** -8
    bound = fixed_point_bound(x, w, scale) * (1 + 1e-6) + rounding * ref.abs() + 1e-30
    assert ((y.double() - ref).abs() <= bound).all()
    return y


def test_packing_round_trips_exactly():
    for k, n in SHAPES:
        w, _ = int8_layer(k, n)
        packed = pack_int8_vnni(w)
        assert packed.dtype == torch.uint8
        assert packed.shape == ((n + 15) // 16, (k + 3) // 4, 16, 4)
        assert torch.equal(unpack_int8_vnni(packed, n, k), w)
        padding = torch.ones(packed.shape[0] * 16, packed.shape[1] * 4, dtype=torch.bool)
        padding[:n, :k] = False  # everything past W holds w = 0, stored as 128
        rows = packed.permute(0, 2, 1, 3).reshape(padding.shape)
        assert (rows[padding] == 128).all()
        assert torch.equal(rows[:n, :k].int() - 128, w.int())


@needs_vnni
@pytest.mark.parametrize("k,n", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_within_the_fixed_point_bound_of_an_fp64_matmul(k, n, dtype):
    w, scale = int8_layer(k, n)
    for m in TOKENS:
        x = wide_activations(m, k, dtype, seed=m)
        check(x, w, scale, fp32_out=True)
        check(x, w, scale, fp32_out=False)


def activations(kind: str, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(8, 1536, generator=g)
    if kind == "outliers":  # 1% of features 100x the rest, as LLM hidden states have
        x = x * torch.where(torch.rand(8, 1536, generator=g) < 0.01, 100.0, 1.0)
    elif kind == "wide":
        x = wide_activations(8, 1536, torch.float32, seed=5)
    return x.to(dtype)


# (activations, dtype, the most the RMS error may be against the fp32 int8_gemv's). Measured
# on these inputs: 0.42x, 1.8x, 2.6x, 11x, 12x, 15x. Plain bf16 activations are exact fixed
# point but for their smallest elements, so the only error left is the output's rounding; the
# 22 bits lose the low bits of elements far below their token's largest, which fp32 keeps.
FACTORS = [("gaussian", torch.bfloat16, 1.0), ("gaussian", torch.float32, 3.0),
           ("outliers", torch.bfloat16, 4.0), ("outliers", torch.float32, 16.0),
           ("wide", torch.bfloat16, 16.0), ("wide", torch.float32, 20.0)]


@needs_vnni
@pytest.mark.parametrize("kind,dtype,factor", FACTORS)
def test_error_within_a_factor_of_the_fp32_kernel(kind, dtype, factor):
    w, scale = int8_layer(1536, 576)
    x = activations(kind, dtype)
    ref = reference(x, w, scale)
    new = (int8_vnni_mm(x, pack_int8_vnni(w), scale, 576, fp32_out=True).double() - ref).abs()
    old = (torch.ops.kiln.int8_gemv(x.float(), w, scale).double() - ref).abs()
    assert new.pow(2).mean().sqrt() <= factor * old.pow(2).mean().sqrt()
    assert new.max() <= 1.5 * factor * old.max()
    typical = ref.abs().mean(dim=1, keepdim=True)  # a token's mean output magnitude
    assert (new / typical).max() < 2.0 ** -11  # a quarter of a bf16 output's rounding step


@needs_vnni
def test_edge_cases():
    w, scale = int8_layer(5, 20)
    packed = pack_int8_vnni(w)
    zeros = int8_vnni_mm(torch.zeros(3, 5), packed, scale, 20)
    assert torch.equal(zeros, torch.zeros(3, 20))
    one_input, one_scale = int8_layer(1, 17)
    check(torch.tensor([[3.0], [-1e-30], [0.0]]), one_input, one_scale, fp32_out=True)
    nan = int8_vnni_mm(torch.tensor([[1.0, float("nan"), 0, 0, 0], [1.0, 2, 3, 4, 5]]),
                       packed, scale, 20)
    assert nan[0].isnan().all() and not nan[1].isnan().any()  # one token's NaN stays its own
    assert int8_vnni_mm(torch.zeros(0, 5), packed, scale, 20).shape == (0, 20)


@needs_vnni
def test_bad_shapes_are_refused_with_the_numbers():
    w, scale = int8_layer(8, 16)
    packed = pack_int8_vnni(w)
    with pytest.raises(RuntimeError, match="x has 12 features, w packs 8"):
        int8_vnni_mm(torch.zeros(1, 12), packed, scale, 16)
    with pytest.raises(RuntimeError, match="3 scales for 16 rows"):
        int8_vnni_mm(torch.zeros(1, 8), packed, scale[:3], 16)
    big = torch.zeros(1, (65536 + 4) // 4, 16, 4, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="65540 input features exceed 65536"):
        int8_vnni_mm(torch.zeros(1, 65540), big, torch.ones(16), 16)


@needs_vnni
def test_a_tokens_outputs_do_not_depend_on_its_batch_or_threads(digits_only):
    w, scale = int8_layer(576, 960, seed=2)
    packed = pack_int8_vnni(w)
    x = wide_activations(21, 576, torch.bfloat16, seed=2)
    alone = torch.cat([int8_vnni_mm(x[i:i + 1], packed, scale, 960) for i in range(21)])
    for m in (2, 4, 7, 8, 13, 21):
        assert torch.equal(int8_vnni_mm(x[:m], packed, scale, 960), alone[:m])
    with single_thread():
        assert torch.equal(int8_vnni_mm(x, packed, scale, 960), alone)


# -- the widened codes (many bf16 tokens) ------------------------------------------------------

needs_wide = pytest.mark.skipif(
    not (int8_vnni_available() and torch.ops.kiln.bf16_vnni_available()),
    reason="no AVX512-VNNI with AVX512-BF16 on this CPU")


@contextlib.contextmanager
def wide_from(tokens: int):
    """The C++ widening threshold set for a block, the loaded one restored after."""
    before = torch.ops.kiln.set_int8_wide_min_tokens(tokens)
    try:
        yield
    finally:
        torch.ops.kiln.set_int8_wide_min_tokens(before)


@pytest.fixture
def digits_only():
    with wide_from(0):
        yield


def fp32_sum_bound(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """What fp32 summation of K exact products, then one multiply by the scale, may be off:
    K 2^-24 sum_k |x w| scale + 2^-24 |result|."""
    k = x.shape[1]
    mags = (x.double().abs() @ w.double().abs().T) * scale.double().reshape(1, -1)
    return mags * k * 2.0 ** -24 + reference(x, w, scale).abs() * 2.0 ** -24


@needs_wide
@pytest.mark.parametrize("k,n", SHAPES)
@pytest.mark.parametrize("m", [16, 17, 40, 130])
@pytest.mark.parametrize("fp32_out", [True, False])
def test_widened_codes_sum_as_an_fp32_matmul(k, n, m, fp32_out):
    w, scale = int8_layer(k, n, seed=k + n)
    x = wide_activations(m, k, torch.bfloat16, seed=m)
    with wide_from(16):
        y = int8_vnni_mm(x, pack_int8_vnni(w), scale, n, fp32_out)
    assert y.dtype == (torch.float32 if fp32_out else torch.bfloat16) and y.shape == (m, n)
    ref = reference(x, w, scale)
    rounding = 0.0 if fp32_out else 2.0 ** -8
    bound = fp32_sum_bound(x, w, scale) * (1 + rounding) + rounding * ref.abs() + 1e-30
    assert ((y.double() - ref).abs() <= bound).all()


@needs_wide
def test_the_threshold_picks_the_path_and_each_path_is_batch_invariant():
    w, scale = int8_layer(576, 960, seed=3)
    packed = pack_int8_vnni(w)
    x = wide_activations(48, 576, torch.bfloat16, seed=3)
    with wide_from(0):
        digits = int8_vnni_mm(x, packed, scale, 960)
    with wide_from(16):
        assert torch.equal(int8_vnni_mm(x[:15], packed, scale, 960), digits[:15])  # below it
        wide = int8_vnni_mm(x, packed, scale, 960)
        assert not torch.equal(wide, digits)  # fp32 sums, not the digits' exact integers
        for start, stop in ((0, 16), (5, 29), (16, 48)):  # any batch past the threshold
            assert torch.equal(int8_vnni_mm(x[start:stop], packed, scale, 960), wide[start:stop])
        with single_thread():
            assert torch.equal(int8_vnni_mm(x, packed, scale, 960), wide)
        # fp32 activations never widen (bf16 would round them): the digits at any count
        xf = x.float()
        with wide_from(0):
            digits32 = int8_vnni_mm(xf, packed, scale, 960)
        assert torch.equal(int8_vnni_mm(xf, packed, scale, 960), digits32)
    with pytest.raises(RuntimeError, match="expected 0"):
        torch.ops.kiln.set_int8_wide_min_tokens(-1)


# -- the linear method -------------------------------------------------------------------------


def int8_linear(weight: torch.Tensor):
    import kiln.quant.linear  # noqa: F401  (registers the quantized formats)
    from kiln.models.layers.linear import Linear, get_linear_method

    method = get_linear_method("int8")
    layer = Linear(weight.shape[1], weight.shape[0], dtype=weight.dtype, method=method)
    method.load_shard(layer, 0, "weight", weight)
    method.finalize(layer)
    return layer


@needs_vnni
def test_the_int8_method_packs_and_reads_back_what_it_stored(monkeypatch):
    weight = torch.randn(40, 33)
    packed = int8_linear(weight)
    assert packed.int8_vnni_weight.shape == (3, 9, 16, 4) and packed.weight.numel() == 0
    monkeypatch.setenv("KILN_INT8_VNNI", "0")
    plain = int8_linear(weight)
    assert not hasattr(plain, "int8_vnni_weight")
    method = packed.method
    assert torch.equal(method.stored(packed, "weight"), plain.weight)
    assert torch.equal(method.dequantize_weight(packed), plain.method.dequantize_weight(plain))
    rows = method.dequantize_rows(packed, slice(17, 35))
    assert torch.equal(rows, plain.method.dequantize_rows(plain, slice(17, 35)))
    exported, expected = method.shard_tensors(packed, 0), plain.method.shard_tensors(plain, 0)
    assert exported.keys() == expected.keys()
    assert all(torch.equal(exported[name], expected[name]) for name in expected)
    x = torch.randn(40, 33)  # past INT8_VNNI_MAX_TOKENS: dequantize + matmul, same weights
    torch.testing.assert_close(packed(x), plain(x))
    before = int8_vnni_calls()
    small = packed(x[:3])
    assert int8_vnni_calls() == before + 1
    torch.testing.assert_close(small, plain(x[:3]), rtol=1e-4, atol=1e-4)
    assert packed.method.apply_fp32(packed, x[:3].bfloat16()).dtype == torch.float32


@needs_wide
def test_long_bf16_steps_take_the_kernel_not_dequantization(monkeypatch):
    from kiln.kernels.quant_mm import int8_wide_unbounded

    if not int8_wide_unbounded():
        pytest.skip("an AMX CPU: oneDNN's AMX GEMM takes long bf16 steps (not measured against)")
    layer = int8_linear(torch.randn(40, 33))
    x = torch.randn(200, 33).bfloat16()  # past INT8_VNNI_MAX_TOKENS
    before = int8_vnni_calls()
    y = layer(x)
    assert int8_vnni_calls() == before + 1
    w = layer.method.stored(layer, "weight")
    assert ((y.double() - reference(x, w, layer.weight_scale)).abs()
            <= fp32_sum_bound(x, w, layer.weight_scale) * (1 + 2 ** -8)
            + reference(x, w, layer.weight_scale).abs() * 2 ** -8).all()
    assert layer.method.stack_tensors(layer).bf16_max_tokens == math.inf
    monkeypatch.setenv("KILN_INT8_WIDE_MIN_TOKENS", "0")  # off: dequantize + matmul, as before
    before = int8_vnni_calls()
    layer(x)
    assert int8_vnni_calls() == before
    assert layer.method.stack_tensors(layer).bf16_max_tokens is None


def test_without_vnni_the_int8_method_keeps_int8_gemv(monkeypatch):
    """The fallback every CPU can run: KILN_INT8_VNNI=0 is what a CPU without AVX512-VNNI gets."""
    monkeypatch.setenv("KILN_INT8_VNNI", "0")
    layer = int8_linear(torch.randn(24, 16))
    assert not hasattr(layer, "int8_vnni_weight") and layer.weight.dtype == torch.int8
    stack = layer.method.stack_tensors(layer)
    assert stack.weight.dim() == 2
    y = layer(torch.randn(2, 16))
    assert y.shape == (2, 24)


# -- a model --------------------------------------------------------------------------------------


def tiny_int8_llm(tiny_ckpt):
    from kiln import LLM

    path = tiny_ckpt("llama", hidden_size=256, intermediate_size=512, num_hidden_layers=3)
    return LLM(path, dtype="bfloat16", kv_cache_memory=16 << 20, num_threads=2,
               quantization="int8")


def greedy(llm) -> list[list[int]]:
    from kiln import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    # the first step (262 tokens, past INT8_VNNI_MAX_TOKENS) widens the codes (decision 0025)
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 17, 40, 200)]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


@needs_vnni
def test_a_tiny_int8_llama_decodes_the_same_through_the_fused_stack(tiny_ckpt, monkeypatch):
    from kiln.runner import fused_stack

    # the reference: the same kernel through the layers one call each (the stack's contract is
    # the same bits as that path)
    monkeypatch.setenv("KILN_DISABLE_FUSED_STACK", "1")
    reference = tiny_int8_llm(tiny_ckpt)
    assert reference.engine.runner.stack is None
    before = int8_vnni_calls()
    old = greedy(reference)
    assert int8_vnni_calls() > before  # the per-layer path ran the kernel too
    monkeypatch.delenv("KILN_DISABLE_FUSED_STACK")
    llm = tiny_int8_llm(tiny_ckpt)
    if llm.engine.runner.stack is None:
        pytest.skip("this machine's model is not on the fused path")
    assert all(w.dim() == 4 for w in llm.engine.runner.stack.qkv)
    stack_calls = []
    real = fused_stack.fused_stack

    def counted(*args):
        before = int8_vnni_calls()
        out = real(*args)
        stack_calls.append(int8_vnni_calls() - before)
        return out

    monkeypatch.setattr(fused_stack, "fused_stack", counted)
    assert greedy(llm) == old
    assert all(c == 4 * 3 for c in stack_calls)  # 4 linears x 3 layers a step
    # every step on the stack, the long first one too where bf16 steps widen the codes
    from kiln.kernels.quant_mm import int8_wide_unbounded

    assert len(stack_calls) == (8 if int8_wide_unbounded() else 7)
