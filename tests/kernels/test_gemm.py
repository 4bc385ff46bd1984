"""gemm.cpp: kiln's int8 weight-only matmul (`int8_gemv`, against dequantize-then-matmul) and
its bf16-weight matmul (`bf16_gemm`, fp32 arithmetic for CPUs without bf16 instructions,
against an exact matmul), and its fp32-output form for the LM head (`bf16_gemm_f32`)."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.common import needs_cpu_kernels

pytestmark = needs_cpu_kernels

# (K, N): the default model's 576x1536 / 1536x576 layers, a K tail, a K below one vector,
# N not a multiple of any row block
SHAPES = [(576, 1536), (1536, 576), (100, 37), (7, 5), (33, 9)]


# -- int8_gemv ---------------------------------------------------------------------------------


def random_layer(k: int, n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 codes [N, K] in -127..127 and fp32 per-row scales [N, 1] spanning 1e-3..1."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scale = torch.logspace(-3, 0, n).reshape(n, 1)
    return w, scale


def check_int8_against_reference(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> None:
    """Within fp32 summation error of the exact sum, plus one rounding to x's dtype."""
    y = torch.ops.kiln.int8_gemv(x, w, scale)
    assert y.shape == (x.shape[0], w.shape[0]) and y.dtype == x.dtype
    deq = w.double() * scale.double().reshape(-1, 1)  # [N, K]
    ref = x.double() @ deq.t()
    magnitude = x.double().abs() @ deq.abs().t()  # sum of |terms|: bounds the fp32 sum error
    rounding = 0.0 if x.dtype == torch.float32 else 2.0 ** -8
    bound = 1e-5 * magnitude + rounding * ref.abs()
    assert ((y.double() - ref).abs() <= bound).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("k", "n"), SHAPES)
def test_int8_gemv_matches_dequantized_matmul(dtype, k, n):
    w, scale = random_layer(k, n)
    for m in range(1, 9):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
        check_int8_against_reference(x, w, scale)


def test_int8_gemv_takes_more_than_eight_tokens_and_a_strided_input():
    w, scale = random_layer(100, 37)
    check_int8_against_reference(torch.randn(19, 100).bfloat16(), w, scale)
    check_int8_against_reference(torch.randn(100, 3).t(), w, scale.reshape(-1))  # [3, 100] view


def test_int8_gemv_rows_do_not_depend_on_the_thread_count():
    w, scale = random_layer(576, 1536)
    x = torch.randn(3, 576).bfloat16()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = torch.ops.kiln.int8_gemv(x, w, scale)
        torch.set_num_threads(2)
        two = torch.ops.kiln.int8_gemv(x, w, scale)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


# -- bf16_gemm ---------------------------------------------------------------------------------


def random_weight(k: int, n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g).bfloat16()


def check_bf16_against_reference(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """Within fp32 summation error of the exact sum, plus one rounding to x's dtype."""
    assert y.shape == (x.shape[0], w.shape[0]) and y.dtype == x.dtype
    ref = x.double() @ w.double().t()
    magnitude = x.double().abs() @ w.double().abs().t()  # bounds the fp32 sum error
    rounding = {torch.float32: 0.0, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}
    bound = 1e-5 * magnitude + rounding[x.dtype] * ref.abs()
    assert ((y.double() - ref).abs() <= bound).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("k", "n"), SHAPES)
def test_bf16_gemm_matches_an_exact_matmul(dtype, k, n):
    w = random_weight(k, n)
    for m in (*range(1, 10), 19):  # odd and even counts (2x2 tiles and their tails), and 19
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
        check_bf16_against_reference(torch.ops.kiln.bf16_gemm(x, w), x, w)


def test_bf16_gemm_takes_a_strided_input_and_refuses_a_bad_weight_dtype():
    w = random_weight(100, 3)
    x = torch.randn(100, 3).bfloat16().t()  # [3, 100] view
    check_bf16_against_reference(torch.ops.kiln.bf16_gemm(x, w), x, w)
    with pytest.raises(RuntimeError, match="bfloat16"):
        torch.ops.kiln.bf16_gemm(x, w.float())


@pytest.mark.parametrize(("op", "n", "tokens", "prefixes"), [
    ("bf16_gemm", 1536, 8, (3,)),
    ("bf16_gemm_f32", 1030, 11, (2, 3, 6)),  # the LM head: fp32 logits
])
def test_a_token_does_not_depend_on_its_batch_or_the_thread_count(op, n, tokens, prefixes):
    gemm = getattr(torch.ops.kiln, op)
    w = random_weight(576, n)
    x = torch.randn(tokens, 576).bfloat16()
    alone = torch.cat([gemm(x[i:i + 1], w) for i in range(tokens)])
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = gemm(x, w)
        torch.set_num_threads(2)
        two = gemm(x, w)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two) and torch.equal(one, alone)
    for m in prefixes:
        assert torch.equal(gemm(x[:m], w), one[:m])


# -- bf16_gemm_f32 (the LM head: fp32 logits) --------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("k", "n"), [*SHAPES, (576, 4099)])
def test_bf16_gemm_f32_writes_fp32_sums_never_rounded(dtype, k, n):
    """fp32 outputs within fp32 summation error of the exact sum (no bf16 rounding: 2^-8 of
    the value would fail the bound), at every token tile and tail (bf16 x runs the AVX512-BF16
    dot products where the CPU has them, fp32 x the widening loop)."""
    w = random_weight(k, n)
    for m in (1, 2, 3, 4, 5, 7, 9, 19):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
        y = torch.ops.kiln.bf16_gemm_f32(x, w)
        assert y.dtype == torch.float32 and y.shape == (m, n)
        ref = x.double() @ w.double().t()
        magnitude = x.double().abs() @ w.double().abs().t()
        assert ((y.double() - ref).abs() <= 1e-5 * magnitude).all()



def test_bf16_gemm_f32_refuses_a_bad_weight_dtype():
    with pytest.raises(RuntimeError, match="bfloat16"):
        torch.ops.kiln.bf16_gemm_f32(torch.randn(2, 8), torch.randn(3, 8))
