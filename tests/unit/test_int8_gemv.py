"""Greedy decoding of an int8 model with and without kiln's int8 weight-only kernel (the
kernel itself: tests/kernels/test_gemm.py, its dispatch: tests/kernels/test_quant_mm.py)."""

from __future__ import annotations

import pytest

from kiln.kernels import cpu as cpu_kernels
from kiln.kernels import quant_mm
from kiln.quant import linear

pytestmark = pytest.mark.skipif(not cpu_kernels.load(), reason="kiln CPU kernels did not build")

@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_decode_matches_the_reference_path(llama_path, monkeypatch, dtype):
    from kiln import LLM, SamplingParams

    calls = []

    def counted(x, weight, scale):
        y = quant_mm.int8_gemv_mm(x, weight, scale)
        calls.append(y is not None)
        return y

    monkeypatch.setattr(linear, "int8_gemv_mm", counted)
    monkeypatch.setenv("KILN_INT8_VNNI", "0")  # int8_gemv's rows (VNNI: test_int8_vnni.py)
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
    monkeypatch.setattr(quant_mm, "INT8_GEMV_MAX_TOKENS", 0)
    calls.clear()
    assert decode() == with_kernel and not any(calls)
