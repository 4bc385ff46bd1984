"""kiln's int8 weight-only kernel (`torch.ops.kiln.int8_gemv`) against dequantize-then-matmul,
and greedy decoding of an int8 model with and without it."""

from __future__ import annotations

import pytest
import torch

from kiln.quant import kernels, linear
from kiln.runner import cpu_ops

pytestmark = pytest.mark.skipif(not cpu_ops.load(), reason="kiln CPU kernels did not build")

# (K, N): the default model's 576x1536 / 1536x576 layers, a K tail, a K below one vector,
# N not a multiple of any row block
SHAPES = [(576, 1536), (1536, 576), (100, 37), (7, 5), (33, 9)]


def random_layer(k: int, n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 codes [N, K] in -127..127 and fp32 per-row scales [N, 1] spanning 1e-3..1."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scale = torch.logspace(-3, 0, n).reshape(n, 1)
    return w, scale


def check_against_reference(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> None:
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
def test_matches_dequantized_matmul(dtype, k, n):
    w, scale = random_layer(k, n)
    for m in range(1, 9):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
        check_against_reference(x, w, scale)


def test_more_than_eight_tokens_and_a_strided_input():
    w, scale = random_layer(100, 37)
    check_against_reference(torch.randn(19, 100).bfloat16(), w, scale)
    check_against_reference(torch.randn(100, 3).t(), w, scale.reshape(-1))  # [3, 100] view


def test_rows_do_not_depend_on_the_thread_count():
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


def test_dispatch_serves_up_to_the_token_limit(monkeypatch):
    w, scale = random_layer(64, 16)
    limit = kernels.INT8_GEMV_MAX_TOKENS
    assert kernels.int8_gemv_mm(torch.randn(limit, 64), w, scale) is not None
    assert kernels.int8_gemv_mm(torch.randn(limit + 1, 64), w, scale) is None
    monkeypatch.setattr(kernels, "INT8_GEMV_MAX_TOKENS", 0)
    assert kernels.int8_gemv_mm(torch.randn(1, 64), w, scale) is None


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_decode_matches_the_reference_path(llama_path, monkeypatch, dtype):
    from kiln import LLM, SamplingParams

    calls = []

    def counted(x, weight, scale):
        y = kernels.int8_gemv_mm(x, weight, scale)
        calls.append(y is not None)
        return y

    monkeypatch.setattr(linear, "int8_gemv_mm", counted)
    llm = LLM(llama_path, dtype=dtype, quantization="int8", kv_cache_memory=8 << 20,
              num_threads=2, enable_prefix_caching=False)
    # layer by layer, where each linear's kernel choice is visible (tests/engine/
    # test_fused_stack.py holds the fused stack's int8 path to this one)
    llm.engine.runner.stack = None
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [{"prompt_token_ids": [1, 5, 9, 14, 3, 7]}, {"prompt_token_ids": list(range(2, 30))}]

    def decode() -> list[list[int]]:
        return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]

    with_kernel = decode()
    assert any(calls)
    monkeypatch.setattr(kernels, "INT8_GEMV_MAX_TOKENS", 0)
    calls.clear()
    assert decode() == with_kernel and not any(calls)
