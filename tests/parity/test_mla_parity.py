"""Parity with HF transformers for DeepSeek-V3's multi-head latent attention (tiny random
checkpoints written by transformers, every layer dense: first_k_dense_replace = layers).

Two variants: YaRN rope scaling (mscale in the softmax scale) with a low-rank query
(q_a_proj -> q_a_layernorm -> q_b_proj) and interleaved rope; plain rope with q_proj and the
halves rope layout.
"""

from __future__ import annotations

import pytest
import torch

from kiln import LLM, SamplingParams
from kiln.models.layers.moe_router import UnsupportedVariant
from tests.parity.test_moe_parity import PROMPTS, assert_logprobs_match, hf_greedy, hf_model

_MLA = {"architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 2, "first_k_dense_replace": 2, "num_attention_heads": 4,
        "num_key_value_heads": 4, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8, "v_head_dim": 16, "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
        "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}
VARIANTS = {
    "yarn": {"q_lora_rank": 32, "rope_interleave": True,
             "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "mscale": 1.0,
                              "mscale_all_dim": 1.0, "original_max_position_embeddings": 256,
                              "beta_fast": 32, "beta_slow": 1}},
    "plain": {"q_lora_rank": None, "rope_interleave": False, "attention_bias": True},
}


def make_tiny_deepseek(path, variant: str = "yarn", seed: int = 0, **overrides) -> str:
    """A random-weight DeepSeek-V3 checkpoint written by transformers, with kiln's tiny
    tokenizer and its weight spread (peaked logits: no greedy near-ties)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from kiln.testing.tiny import _spread_weights, make_tokenizer

    tokenizer = make_tokenizer()
    cfg = {**_MLA, **VARIANTS[variant], "vocab_size": len(tokenizer), **overrides}
    config = AutoConfig.for_model("deepseek_v3", **cfg)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _spread_weights(model, seed)
    model.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    return str(path)


@pytest.fixture(scope="module")
def deepseek_ckpt(tmp_path_factory):
    made: dict[str, str] = {}

    def make(variant: str) -> str:
        if variant not in made:
            made[variant] = make_tiny_deepseek(tmp_path_factory.mktemp(variant), variant)
        return made[variant]

    return make


@pytest.mark.parametrize("variant, kernels", [("yarn", "auto"), ("yarn", "torch"),
                                              ("plain", "auto")])
def test_greedy_tokens_match_hf_in_a_batch(deepseek_ckpt, variant, kernels):
    """Three prompts of different lengths batched together, 32 greedy tokens each; `auto`
    runs the cpu backend (MLA on its torch path), `torch` the reference backend."""
    path = deepseek_ckpt(variant)
    llm = LLM(path, dtype="float32", kv_cache_memory=8 << 20, num_threads=1, kernels=kernels)
    prompt_ids = [llm.get_tokenizer().encode(p) for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params)
    hf = hf_model(path)
    for ids, out in zip(prompt_ids, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(hf, ids, 32)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logprobs_match_hf_with_prefix_hit_and_chunked_prefill(deepseek_ckpt, variant):
    """Prefill in 16-token chunks; a second prompt shares the first's 32-token prefix, whose
    latent blocks come from the prefix cache."""
    path = deepseek_ckpt(variant)
    llm = LLM(path, dtype="float32", kv_cache_memory=8 << 20, num_threads=1, block_size=16,
              max_num_batched_tokens=16, enable_prefix_caching=True)
    tok = llm.get_tokenizer()
    first = tok.encode(PROMPTS[2] * 2)
    second = first[:32] + tok.encode(PROMPTS[1])
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5,
                            prompt_logprobs=5)
    hf = hf_model(path)
    assert_logprobs_match(hf, first, llm.generate([{"prompt_token_ids": first}], params)[0],
                          atol=1e-4)
    sample_params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5)
    second_out = llm.generate([{"prompt_token_ids": second}], sample_params)[0]
    assert second_out.num_cached_tokens == 32
    assert_logprobs_match(hf, second, second_out, atol=1e-4)
    assert second_out.outputs[0].token_ids == hf_greedy(hf, second, 8)


def test_bf16_stays_close_to_hf_fp32(deepseek_ckpt):
    path = deepseek_ckpt("yarn")
    llm = LLM(path, dtype="bfloat16", kv_cache_memory=8 << 20, num_threads=1, kernels="auto")
    ids = llm.get_tokenizer().encode(PROMPTS[2])
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=3,
                            prompt_logprobs=3)
    out = llm.generate([{"prompt_token_ids": ids}], params)[0]
    assert_logprobs_match(hf_model(path), ids, out, atol=0.25)
    assert llm.engine.runner.stack is None  # MLA blocks stay off the fused Llama stack


def test_sparse_layers_match_hf(tmp_path):
    """Layers past first_k_dense_replace are DeepSeek's mixtures of experts (sigmoid router,
    bias-corrected grouped top-k, shared experts): greedy tokens and logprobs as HF's."""
    path = make_tiny_deepseek(tmp_path / "sparse", "yarn", first_k_dense_replace=1,
                              n_routed_experts=8, num_experts_per_tok=2, n_group=4,
                              topk_group=2, moe_intermediate_size=16, n_shared_experts=1,
                              routed_scaling_factor=2.5, norm_topk_prob=True)
    hf = hf_model(path)
    with torch.no_grad():  # a nonzero score-correction bias, so choosing differs from weighting
        for layer in hf.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.uniform_(-0.5, 0.5)
    hf.save_pretrained(path)
    llm = LLM(path, dtype="float32", kv_cache_memory=8 << 20, num_threads=1)
    prompt_ids = [llm.get_tokenizer().encode(p) for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=3,
                            prompt_logprobs=3)
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params)
    for ids, out in zip(prompt_ids, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(hf, ids, 32)
    assert_logprobs_match(hf, prompt_ids[2], outs[2], atol=1e-4)


@pytest.mark.parametrize("field, value", [("hidden_act", "gelu"), ("index_topk", 2048)])
def test_an_unsupported_variant_fails_at_load_naming_the_field(deepseek_ckpt, tmp_path, field,
                                                               value):
    import json
    import shutil

    path = tmp_path / "variant"
    shutil.copytree(deepseek_ckpt("plain"), path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, field: value}))
    with pytest.raises(UnsupportedVariant, match=field) as err:
        LLM(str(path), dtype="float32", kv_cache_memory=8 << 20, num_threads=1)
    assert err.value.field == field


def test_teacher_forcing_scores_like_hf(deepseek_ckpt):
    """kiln.runner.scoring (quantization's KL probe) over MLA: its scratch cache takes the
    model's latent layout, and its log-probabilities match HF's."""
    from kiln.models.loader import load_model
    from kiln.runner.attention import get_attention_backend
    from kiln.runner.scoring import TeacherForcer

    path = deepseek_ckpt("yarn")
    model = load_model(path, torch.float32, get_attention_backend("torch")).model
    windows = torch.randint(5, 400, (3, 20), generator=torch.Generator().manual_seed(0))
    forcer = TeacherForcer(model, windows, windows_per_step=2)
    assert [tuple(t.shape[1:]) for t in forcer.kv[0]] == [(1, 40)]
    got = torch.cat([forcer.log_probs(forcer.forward(step)) for step in forcer.steps])
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(path)(windows).logits.float(), dim=-1)
    torch.testing.assert_close(got.view(3, 20, -1), ref, atol=1e-4, rtol=1e-4)


def test_an_int8_checkpoint_round_trips_with_kv_b_proj_kept(deepseek_ckpt, tmp_path):
    """`kiln quantize`'s checkpoint of a DeepSeek model: every Linear int8, kv_b_proj (read as
    matrices by the absorbed form) stored as it was; reloaded, the same logits as quantizing
    on load."""
    from kiln.models.loader import load_model
    from kiln.quant.checkpoint import write_checkpoint
    from kiln.quant.pipeline import Reference, uniform_plan
    from kiln.runner.attention import get_attention_backend
    from kiln.runner.scoring import TeacherForcer

    path = deepseek_ckpt("plain")
    plan = uniform_plan(Reference(path).shapes(), "int8")
    assert not any("kv_b_proj" in name for name in plan)
    out = write_checkpoint(path, tmp_path / "int8", plan, "int8")
    windows = torch.randint(5, 400, (2, 24), generator=torch.Generator().manual_seed(1))

    def logits(model):
        forcer = TeacherForcer(model, windows)
        return torch.cat([model.compute_logits(forcer.forward(s)) for s in forcer.steps])

    def load(p, **kw):
        return load_model(p, torch.float32, get_attention_backend("torch"), **kw).model

    assert torch.equal(logits(load(out)), logits(load(path, quantization="int8")))
