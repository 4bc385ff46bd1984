"""The linear method over kiln's bf16-weight kernel (`torch.ops.kiln.bf16_gemm`, fp32 arithmetic
for CPUs without bf16 instructions; the kernel itself: tests/kernels/test_gemm.py): which token
counts it serves, when the loader picks it, and greedy decoding through it."""

from __future__ import annotations

import pytest
import torch

from kiln.kernels import bf16_mm
from kiln.kernels import cpu as cpu_kernels
from kiln.models import loader
from kiln.models.layers.linear import Linear, get_linear_method

pytestmark = pytest.mark.skipif(not cpu_kernels.load(), reason="kiln CPU kernels did not build")


def random_weight(k: int, n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g).bfloat16()


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
    monkeypatch.setattr(bf16_mm, "_kernel", lambda x, weight: calls.append(1) or kernel(x, weight))
    limit = bf16_mm.BF16_GEMM_MAX_TOKENS
    for shape, by_kernel in (((1, 64), True), ((limit, 64), True), ((limit + 1, 64), False),
                             ((2, 3, 64), True)):  # a leading batch dim is flattened, restored
        calls.clear()
        x = torch.randn(*shape).bfloat16()
        y = layer(x)
        assert y.shape == (*shape[:-1], 40) and bool(calls) == by_kernel
        ref = torch.nn.functional.linear(x.float(), w.float(), layer.bias.float())
        assert torch.allclose(y.float(), ref, rtol=2 ** -7, atol=1e-2)


def test_auto_picks_it_only_where_onednn_cannot_run(monkeypatch):
    from kiln.kernels import bf16_vnni

    assert loader.dense_method(torch.float32) == "dense"
    assert loader.dense_method(torch.bfloat16, "torch") == "dense"
    assert loader.dense_method(torch.bfloat16, "bf16-fp32") == "dense-bf16-fp32"
    monkeypatch.setattr(bf16_vnni, "vnni_available", lambda: True)
    assert loader.dense_method(torch.bfloat16) in ("dense-vnni", "dense-onednn")  # AMX: oneDNN
    monkeypatch.setattr(bf16_vnni, "vnni_available", lambda: False)
    with pytest.raises(ValueError, match="vnni needs bf16 weights and a CPU with AVX512-BF16"):
        loader.dense_method(torch.bfloat16, "vnni")
    monkeypatch.setattr(bf16_mm, "onednn_available", lambda dtype: False)
    assert loader.dense_method(torch.bfloat16) == "dense-bf16-fp32"
    monkeypatch.setattr(bf16_mm, "onednn_available", lambda dtype: True)
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
