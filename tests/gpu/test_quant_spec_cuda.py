"""Quantized linears and speculative decoding on a CUDA GPU: int8/fp8 weight-only layers
through the Triton GEMV give the torch path's greedy tokens (fp32); a draft model (its pool
sized from the card's memory beside the target's) and an EAGLE head on the GPU give the tokens
without speculation. Skipped without a GPU (tests/conftest.py); benchmarks/gpu_check.py runs
them. Their CPU twins, in Triton's interpreter: tests/kernels/triton/test_quant_dispatch.py
and test_speculative_triton.py."""

from __future__ import annotations

import pytest
import torch

from kiln import LLM, SamplingParams
from kiln.config_speculative import SpeculativeConfig
from kiln.models.layers.linear import Linear

pytestmark = pytest.mark.gpu

PROMPTS = ["The quick brown fox jumps over the lazy dog. The quick", "def add(a, b):"]
PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
SPEC = SpeculativeConfig(num_speculative_tokens=2, adaptive=False, ngram_first=False,
                         tree_width=1)


def greedy(path: str, **settings) -> tuple[LLM, list[list[int]]]:
    llm = LLM(path, device="cuda", dtype="float32", kv_cache_memory=64 << 20, max_num_seqs=4,
              **settings)
    return llm, [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


@pytest.mark.parametrize("quantization", ["int8", "fp8"])
def test_quantized_linears_take_the_triton_gemv_on_the_gpu(llama_path, quantization):
    _, expected = greedy(llama_path, quantization=quantization, kernels="torch",
                         attention_backend="torch")
    llm, tokens = greedy(llama_path, quantization=quantization)
    assert tokens == expected
    methods = [m.method for m in llm.engine.runner.model.modules()
               if isinstance(m, Linear) and hasattr(m.method, "triton_gemv_rows")]
    assert methods and all(m.triton_gemv_rows for m in methods)


@pytest.fixture(scope="module")
def head_path(llama_path, tmp_path_factory) -> str:
    from kiln.models.loader import read_hf_config
    from kiln.models.registry import resolve_architecture
    from kiln.speculative.head.model import EagleHead, HeadConfig, save_head

    _, arch = resolve_architecture(read_hf_config(llama_path))
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("head")
    save_head(EagleHead(HeadConfig.for_target(arch, 256, (0, -1))), out, torch.float32)
    return str(out)


@pytest.mark.parametrize("proposer", ["draft", "head"])
def test_speculation_on_the_gpu_gives_the_tokens_without_it(llama_path, tiny_ckpt, head_path,
                                                            proposer):
    speculator = {"draft": tiny_ckpt("llama", num_hidden_layers=1), "head": head_path}[proposer]
    _, expected = greedy(llama_path)
    llm, tokens = greedy(llama_path, speculator=speculator, speculative_config=SPEC)
    assert tokens == expected and llm.engine.speculator.stats.num_draft_tokens > 0
    device = llm.engine.runner.device
    proposer_ = llm.engine.speculator.proposer
    held = proposer_.runner.model if proposer == "draft" else proposer_.head
    assert {t.device for t in [*held.parameters(), *held.buffers()]} == {device}
    if proposer == "draft":  # no draft_kv_cache_memory: sized from the card's memory
        assert all(k.device == device for k, _ in proposer_.runner.kv_caches)
        assert proposer_.runner.pool_blocks <= llm.engine.runner.pool_blocks
