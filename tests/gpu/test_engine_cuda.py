"""The engine on a CUDA GPU: greedy tokens against HF transformers on the same GPU (fp32 equal,
bf16 within a near tie of HF's best at every position), CUDA graphs against eager steps
(identical tokens), and the KV pool sized from the card's memory. Skipped without a GPU
(tests/conftest.py); benchmarks/gpu_check.py runs them."""

from __future__ import annotations

import gc

import pytest
import torch

from kiln import LLM, SamplingParams
from kiln.runner.cuda_graphs import run_buckets_eagerly
from kiln.testing.hf_compare import agreement, load_hf

pytestmark = pytest.mark.gpu

PROMPTS = ["The quick brown fox", "def add(a, b):\n    return",
           "Paris is the capital of France. Large language models predict the next token and",
           "0123"]
BF16_TOLERANCE = 0.05  # logits of the tiny random models are near 1: a few bf16 steps


def kiln_greedy(path: str, dtype: str, max_tokens: int = 24, **settings
                ) -> tuple[LLM, list[list[int]], list[list[int]]]:
    llm = LLM(path, device="cuda", dtype=dtype, kv_cache_memory=64 << 20, max_num_seqs=8,
              **settings)
    tok = llm.get_tokenizer()
    ids = [tok.encode(p) for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": i} for i in ids], params, use_tqdm=False)
    return llm, ids, [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_fp32_greedy_tokens_equal_hf_on_the_gpu(llama_path, backend):
    llm, ids, tokens = kiln_greedy(llama_path, "float32", attention_backend=backend)
    assert llm.engine.runner.device.type == "cuda"
    assert llm.engine.runner.platform.attention_backend == backend
    result = agreement(load_hf(llama_path, torch.float32, torch.device("cuda")), ids, tokens)
    assert result.first_split == [None] * len(PROMPTS) and result.exact


def test_bf16_greedy_tokens_are_hf_near_best_on_the_gpu(llama_path):
    _, ids, tokens = kiln_greedy(llama_path, "bfloat16")
    result = agreement(load_hf(llama_path, torch.bfloat16, torch.device("cuda")), ids, tokens)
    assert result.within(BF16_TOLERANCE), result


def graphs_and(llama_path: str, dtype: str, padded: bool) -> tuple[LLM, LLM]:
    """An engine with CUDA graphs, and one without: plain eager steps, or (padded) the same
    bucketed steps run eagerly over the same buffers and metadata."""
    def build(enforce_eager: bool) -> LLM:
        return LLM(llama_path, device="cuda", dtype=dtype, kv_cache_memory=64 << 20,
                   max_num_seqs=4, enforce_eager=enforce_eager)

    graphs, eager = build(False), build(True)
    assert graphs.engine.runner.graphs is not None and eager.engine.runner.graphs is None
    if padded:
        run_buckets_eagerly(eager.engine.runner, 4, eager.engine.max_model_len)
    return graphs, eager


@pytest.mark.parametrize(("dtype", "padded"), [("float32", False), ("float32", True),
                                               ("bfloat16", True)])
def test_cuda_graphs_give_the_eager_tokens(llama_path, dtype, padded):
    """Batches inside a bucket (3 of 4: one padding row), at a bucket's size, and above the
    largest bucket (eager for both). Against the same padded steps run eagerly the tokens are
    equal in any dtype (a replay repeats the computation); against plain eager steps, whose
    matmuls see n rows instead of the bucket's (cuBLAS may sum them in another order), in
    fp32, where that cannot move a greedy choice."""
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    graphs, eager = graphs_and(llama_path, dtype, padded)
    prompts = PROMPTS + ["Inference servers batch requests together."]
    for batch in (prompts[:1], prompts[:3], prompts[:4], prompts):
        want = [o.outputs[0].token_ids for o in eager.generate(batch, params, use_tqdm=False)]
        got = [o.outputs[0].token_ids for o in graphs.generate(batch, params, use_tqdm=False)]
        assert got == want, len(batch)
    assert graphs.engine.runner.graphs.served > 0


def test_kv_pool_sized_from_gpu_memory(llama_path):
    gc.collect()  # the engines of earlier tests
    torch.cuda.empty_cache()
    # blocks of 128 tokens: the tiny model's 16-token blocks would be millions of blocks
    llm = LLM(llama_path, device="cuda", dtype="bfloat16", gpu_memory_utilization=0.3,
              max_num_seqs=8, block_size=128)
    runner = llm.engine.runner
    free, total = torch.cuda.mem_get_info()
    pool_bytes = llm.engine.limits.num_kv_blocks * runner.kv_spec.bytes_per_block
    assert pool_bytes > 0.1 * total  # a tiny model leaves most of 30% to the pool
    assert torch.cuda.memory_reserved() <= 0.3 * total
    out = llm.generate(["The quick brown fox"], SamplingParams(max_tokens=4, temperature=0),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
