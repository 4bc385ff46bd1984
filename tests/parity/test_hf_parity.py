"""Parity with HF transformers on tiny random checkpoints of every family (fp32)."""

from __future__ import annotations

import pytest
import torch

from kiln import LLM, SamplingParams
from kiln.testing.tiny import FAMILIES

PROMPTS = [
    "The quick brown fox",
    "def add(a, b):\n    return",
    "Paris is the capital of France. Large language models predict the next token and",
    "0123",
]


def hf_greedy(path: str, prompt_ids: list[int], max_new: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.generation_config.eos_token_id = None  # like ignore_eos: EOS may be chosen, no stop
    ids = torch.tensor([prompt_ids])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                         do_sample=False, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


def hf_logprobs(path: str, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


@pytest.mark.parametrize("family, kernels", [(f, "auto") for f in FAMILIES]
                         + [("llama", "torch"), ("qwen3", "torch")])
def test_greedy_tokens_match_hf_in_a_batch(tiny_ckpt, family, kernels):
    """`auto` runs the C++ kernels where they build; `torch` is the plain reference path."""
    path = tiny_ckpt(family)
    llm = LLM(path, dtype="float32", kv_cache_memory=8 << 20, num_threads=1, kernels=kernels)
    tok = llm.get_tokenizer()
    prompt_ids = [tok.encode(p) for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params)
    for ids, out in zip(prompt_ids, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(path, ids, 32)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_logprobs_match_hf_in_mixed_prefill_and_decode_batch(tiny_ckpt, family):
    """One request decodes while another prefills in the same step (chunked, tiny budget)."""
    path = tiny_ckpt(family)
    llm = LLM(path, dtype="float32", kv_cache_memory=8 << 20, num_threads=1,
              max_num_batched_tokens=24)
    tok = llm.get_tokenizer()
    long_ids = tok.encode(PROMPTS[2] * 3)
    short_ids = tok.encode(PROMPTS[0])
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5,
                            prompt_logprobs=5)
    outs = llm.generate([{"prompt_token_ids": short_ids}, {"prompt_token_ids": long_ids}],
                        params)
    for ids, out in zip([short_ids, long_ids], outs, strict=True):
        full = ids + out.outputs[0].token_ids
        ref = hf_logprobs(path, full)
        got = [None] * (len(ids) - 1) + out.outputs[0].logprobs  # positions predicting full[i+1]
        for pos, entry in enumerate(out.prompt_logprobs[1:]):
            got[pos] = entry
        for pos, entry in enumerate(got):
            for token, lp in entry.items():
                assert abs(lp.logprob - float(ref[pos, token])) < 1e-4, (pos, token)
