"""kiln's bf16-weight kernel (`torch.ops.kiln.bf16_gemm`, fp32 arithmetic for CPUs without bf16
instructions) against an exact matmul, and greedy decoding through its linear method."""

from __future__ import annotations

import pytest
import torch

from kiln.models import loader
from kiln.models.layers import cpu_bf16
from kiln.models.layers.linear import Linear, get_linear_method
from kiln.runner import cpu_ops

pytestmark = pytest.mark.skipif(not cpu_ops.load(), reason="kiln CPU kernels did not build")

# (K, N): the default model's 576x1536 / 1536x576 layers, a K tail, a K below one vector,
# N not a multiple of any row block
SHAPES = [(576, 1536), (1536, 576), (100, 37), (7, 5), (33, 9)]


def random_weight(k: int, n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g).bfloat16()


def check_against_reference(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """Within fp32 summation error of the exact sum, plus one rounding to x's dtype."""
    assert y.shape == (x.shape[0], w.shape[0]) and y.dtype == x.dtype
    ref = x.double() @ w.double().t()
    magnitude = x.double().abs() @ w.double().abs().t()  # bounds the fp32 sum error
    rounding = {torch.float32: 0.0, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}
    bound = 1e-5 * magnitude + rounding[x.dtype] * ref.abs()
    assert ((y.double() - ref).abs() <= bound).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("k", "n"), SHAPES)
def test_kernel_matches_an_exact_matmul(dtype, k, n):
    w = random_weight(k, n)
    for m in (*range(1, 10), 19):  # every tile width, and more than one tile of 8
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
        check_against_reference(torch.ops.kiln.bf16_gemm(x, w), x, w)


def test_a_strided_input_and_a_bad_weight_dtype():
    w = random_weight(100, 3)
    x = torch.randn(100, 3).bfloat16().t()  # [3, 100] view
    check_against_reference(torch.ops.kiln.bf16_gemm(x, w), x, w)
    with pytest.raises(RuntimeError, match="bfloat16"):
        torch.ops.kiln.bf16_gemm(x, w.float())


def test_a_token_does_not_depend_on_its_batch_or_the_thread_count():
    w = random_weight(576, 1536)
    x = torch.randn(8, 576).bfloat16()
    alone = torch.cat([torch.ops.kiln.bf16_gemm(x[i:i + 1], w) for i in range(8)])
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = torch.ops.kiln.bf16_gemm(x, w)
        torch.set_num_threads(2)
        two = torch.ops.kiln.bf16_gemm(x, w)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two) and torch.equal(one, alone)
    assert torch.equal(torch.ops.kiln.bf16_gemm(x[:3], w), one[:3])


def test_linear_method_serves_few_tokens_by_kernel_and_more_by_widening(monkeypatch):
    w = random_weight(64, 40)
    layer = Linear(64, [24, 16], bias=True, dtype=torch.bfloat16,
                   method=get_linear_method("dense-bf16-fp32"))
    for shard, rows in ((0, slice(0, 24)), (1, slice(24, 40))):
        layer.method.load_shard(layer, shard, "weight", w[rows])
        layer.method.load_shard(layer, shard, "bias", torch.arange(rows.stop - rows.start)
                                .bfloat16())
    layer.method.finalize(layer)
    calls = []
    kernel = torch.ops.kiln.bf16_gemm
    monkeypatch.setattr(cpu_bf16, "_kernel", lambda x, weight: calls.append(1) or kernel(x, weight))
    limit = cpu_bf16.BF16_GEMM_MAX_TOKENS
    for shape, by_kernel in (((1, 64), True), ((limit, 64), True), ((limit + 1, 64), False),
                             ((2, 3, 64), True)):  # a leading batch dim is flattened, restored
        calls.clear()
        x = torch.randn(*shape).bfloat16()
        y = layer(x)
        assert y.shape == (*shape[:-1], 40) and bool(calls) == by_kernel
        ref = torch.nn.functional.linear(x.float(), w.float(), layer.bias.float())
        assert torch.allclose(y.float(), ref, rtol=2 ** -7, atol=1e-2)


def test_auto_picks_it_only_where_onednn_cannot_run(monkeypatch):
    from kiln.models.layers import onednn

    assert loader.dense_method(torch.float32) == "dense"
    assert loader.dense_method(torch.bfloat16, "torch") == "dense"
    assert loader.dense_method(torch.bfloat16, "bf16-fp32") == "dense-bf16-fp32"
    monkeypatch.setattr(onednn, "onednn_available", lambda dtype: False)
    assert loader.dense_method(torch.bfloat16) == "dense-bf16-fp32"
    monkeypatch.setattr(onednn, "onednn_available", lambda dtype: True)
    assert loader.dense_method(torch.bfloat16) == "dense-onednn"
    with pytest.raises(ValueError, match="bf16-fp32 needs bf16"):
        loader.dense_method(torch.float32, "bf16-fp32")


def test_greedy_decode_matches_torchs_bf16_matmul(llama_path):
    from kiln import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [{"prompt_token_ids": [1, 5, 9, 14, 3, 7]}, {"prompt_token_ids": list(range(2, 30))}]

    def decode(backend: str) -> list[list[int]]:
        llm = LLM(llama_path, dtype="bfloat16", kv_cache_memory=8 << 20, num_threads=2,
                  enable_prefix_caching=False, linear_backend=backend)
        assert type(llm.engine.runner.model.lm_head.method).__name__ == (
            "CpuBf16LinearMethod" if backend == "bf16-fp32" else "DenseLinearMethod")
        return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]

    assert decode("bf16-fp32") == decode("torch")
