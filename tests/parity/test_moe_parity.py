"""Parity with HF transformers for the mixture-of-experts families (tiny random checkpoints).

Each family is made tiny with transformers' own config class (hidden 64, 2 layers, 8 experts)
and saved with `save_pretrained`, so kiln reads exactly what HF writes (per-expert tensors).
"""

from __future__ import annotations

import pytest
import torch

from kiln import LLM, SamplingParams
from kiln.models.layers.moe_router import UnsupportedVariant

PROMPTS = [
    "The quick brown fox",
    "def add(a, b):\n    return",
    "Paris is the capital of France. Large language models predict the next token and",
]
_ATTENTION = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "max_position_embeddings": 1024, "rms_norm_eps": 1e-6,
              "rope_theta": 10000.0, "tie_word_embeddings": False, "hidden_act": "silu",
              "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}
# model_type -> the family's own routing fields; qwen2_moe keeps layer 1 dense; glm4_moe is
# GLM-4.5-Air's shape (q/k/v bias, no q/k norm, half the head rotary, layer 0 dense) with
# grouped routing (4 groups of 2, the best 2), scaled weights and two shared experts
MOE_CONFIGS = {
    "mixtral": {"architectures": ["MixtralForCausalLM"], "intermediate_size": 64,
                "num_local_experts": 8, "num_experts_per_tok": 2},
    "qwen2_moe": {"architectures": ["Qwen2MoeForCausalLM"], "intermediate_size": 96,
                  "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64,
                  "num_experts": 8, "num_experts_per_tok": 4, "norm_topk_prob": False,
                  "mlp_only_layers": [1]},
    "qwen3_moe": {"architectures": ["Qwen3MoeForCausalLM"], "intermediate_size": 96,
                  "moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2,
                  "norm_topk_prob": True, "head_dim": 32},
    "glm4_moe": {"architectures": ["Glm4MoeForCausalLM"], "intermediate_size": 96,
                 "moe_intermediate_size": 32, "n_routed_experts": 8, "num_experts_per_tok": 2,
                 "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5,
                 "norm_topk_prob": True, "n_shared_experts": 2, "first_k_dense_replace": 1,
                 "head_dim": 32, "partial_rotary_factor": 0.5, "attention_bias": True,
                 "use_qk_norm": False},
}


def make_tiny_moe(path, model_type: str, seed: int = 0, **overrides) -> str:
    """A random-weight checkpoint of `model_type` written by transformers, with kiln's tiny
    tokenizer and its weight spread (peaked logits: no greedy near-ties); a score-correction
    bias (a buffer HF initializes to zero) gets values that change which experts run."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from kiln.testing.tiny import _spread_weights, make_tokenizer

    tokenizer = make_tokenizer()
    cfg = {**_ATTENTION, **MOE_CONFIGS[model_type], "vocab_size": len(tokenizer), **overrides}
    config = AutoConfig.for_model(model_type, **cfg)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _spread_weights(model, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.2 * torch.randn(buffer.shape, generator=gen))
    model.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    return str(path)


@pytest.fixture(scope="module")
def moe_ckpt(tmp_path_factory):
    made: dict[str, str] = {}

    def make(model_type: str) -> str:
        if model_type not in made:
            made[model_type] = make_tiny_moe(tmp_path_factory.mktemp(model_type), model_type)
        return made[model_type]

    return make


def hf_model(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_greedy(model, prompt_ids: list[int], max_new: int) -> list[int]:
    model.generation_config.eos_token_id = None  # like ignore_eos
    ids = torch.tensor([prompt_ids])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                         do_sample=False, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


def hf_logprobs(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


@pytest.mark.parametrize("model_type, kernels", [(m, "auto") for m in sorted(MOE_CONFIGS)]
                         + [("qwen2_moe", "torch"), ("glm4_moe", "torch")])
def test_greedy_tokens_match_hf_in_a_batch(moe_ckpt, model_type, kernels):
    """Three prompts of different lengths batched together, 32 greedy tokens each; `auto`
    runs the C++ kernels where they build, `torch` the plain reference path."""
    path = moe_ckpt(model_type)
    llm = LLM(path, dtype="float32", kv_cache_memory=8 << 20, num_threads=1, kernels=kernels)
    prompt_ids = [llm.get_tokenizer().encode(p) for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params)
    hf = hf_model(path)
    for ids, out in zip(prompt_ids, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(hf, ids, 32)


def assert_logprobs_match(hf, ids: list[int], out, atol: float) -> float:
    """Every reported prompt and sample logprob against HF's on the full sequence; returns the
    largest difference."""
    full = ids + out.outputs[0].token_ids
    ref = hf_logprobs(hf, full)
    got = [None] * (len(ids) - 1) + out.outputs[0].logprobs  # position i predicts full[i + 1]
    for pos, entry in enumerate(out.prompt_logprobs[1:] if out.prompt_logprobs else []):
        got[pos] = entry
    worst = 0.0
    for pos, entry in enumerate(got):
        for token, lp in (entry or {}).items():
            worst = max(worst, abs(lp.logprob - float(ref[pos, token])))
    assert worst < atol
    return worst


@pytest.mark.parametrize("model_type", sorted(MOE_CONFIGS))
def test_logprobs_match_hf_with_prefix_hit_and_chunked_prefill(moe_ckpt, model_type):
    """Prefill in 16-token chunks; a second prompt shares the first's 32-token prefix, served
    from the prefix cache."""
    path = moe_ckpt(model_type)
    llm = LLM(path, dtype="float32", kv_cache_memory=8 << 20, num_threads=1, block_size=16,
              max_num_batched_tokens=16, enable_prefix_caching=True)
    tok = llm.get_tokenizer()
    first = tok.encode(PROMPTS[2] * 2)
    second = first[:32] + tok.encode(PROMPTS[1])
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5,
                            prompt_logprobs=5)
    hf = hf_model(path)
    first_out = llm.generate([{"prompt_token_ids": first}], params)[0]
    assert_logprobs_match(hf, first, first_out, atol=1e-4)
    # prompt logprobs would recompute the prefix: the second request asks for samples' only
    sample_params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5)
    second_out = llm.generate([{"prompt_token_ids": second}], sample_params)[0]
    assert second_out.num_cached_tokens == 32
    assert_logprobs_match(hf, second, second_out, atol=1e-4)
    assert second_out.outputs[0].token_ids == hf_greedy(hf, second, 8)


@pytest.mark.parametrize("model_type", ["mixtral", "qwen2_moe", "qwen3_moe", "glm4_moe"])
def test_bf16_with_cpu_kernels_stays_close_to_hf_fp32(moe_ckpt, model_type):
    """The bf16 path (the fused expert kernel, or oneDNN or kiln's bf16 GEMM per expert, the
    C++ ops; Mixtral and Qwen3-MoE inside the fused decoder stack where it runs) and its
    logprobs stay within bf16's reach of the fp32 reference."""
    path = moe_ckpt(model_type)
    llm = LLM(path, dtype="bfloat16", kv_cache_memory=8 << 20, num_threads=1, kernels="auto")
    ids = llm.get_tokenizer().encode(PROMPTS[2])
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=3,
                            prompt_logprobs=3)
    out = llm.generate([{"prompt_token_ids": ids}], params)[0]
    assert_logprobs_match(hf_model(path), ids, out, atol=0.25)
    # the fused decoder stack runs softmax-routed blocks without a shared expert, on the
    # fused expert kernel's bf16 experts, where the platform offers the stack
    runner = llm.engine.runner
    blocks = [b for b in (layer.sparse_moe() for layer in runner.model.model.layers) if b]
    stackable = (model_type in ("mixtral", "qwen3_moe") and runner.platform.fused_stack
                 and all(b.experts.stacked is not None for b in blocks))
    assert (runner.stack is not None) == stackable


def test_int8_experts_load_through_the_quantized_format(moe_ckpt):
    """`quantization="int8"` reaches every expert's linears (the router stays dense)."""
    llm = LLM(moe_ckpt("qwen3_moe"), dtype="float32", kv_cache_memory=8 << 20, num_threads=1,
              quantization="int8")
    block = llm.engine.runner.model.model.layers[0].mlp
    assert {type(e.gate_up_proj.method).__name__ for e in block.experts} == {"Int8LinearMethod"}
    assert block.gate.weight.dtype == torch.float32
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    assert len(llm.generate(PROMPTS[:2], params)[1].outputs[0].token_ids) == 4


@pytest.mark.parametrize("model_type, field, value", [
    ("qwen3_moe", "scoring_func", "sigmoid"),  # DeepSeek-V3's router
    ("qwen3_moe", "n_group", 8),  # grouped top-k
    ("mixtral", "kv_lora_rank", 512),  # multi-head latent attention
    ("mixtral", "router_type", "expert_choice"),  # a routing option kiln has never seen
    ("qwen2_moe", "hidden_act", "gelu"),
    ("mixtral", "num_experts_per_tok", 9),  # more than the 8 experts
    ("glm4_moe", "scoring_func", "softmax"),
    ("glm4_moe", "topk_method", "group_limited_greedy"),  # DeepSeek-V2's group rule
    ("glm4_moe", "index_topk", 2048),  # DeepSeek-V3.2's / GLM's sparse-attention indexer
    ("glm4_moe", "kv_lora_rank", 512),
    ("glm4_moe", "n_group", 3),  # 8 experts do not split in 3 groups
    ("glm4_moe", "first_k_dense_replace", -1),
])
def test_unsupported_variant_fails_at_load_naming_the_field(tmp_path, moe_ckpt, model_type,
                                                            field, value):
    import json
    import shutil

    path = tmp_path / "variant"
    shutil.copytree(moe_ckpt(model_type), path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, field: value}))
    with pytest.raises(UnsupportedVariant, match=field) as err:
        LLM(str(path), dtype="float32", kv_cache_memory=8 << 20, num_threads=1)
    assert err.value.field == field


def test_glm_with_qk_norm_and_a_quarter_rotary_matches_hf(tmp_path):
    """GLM-4.5's own shape: q/k RMSNorm per head (the split-heads rotary path) and a rotary
    slice other than half the head."""
    path = make_tiny_moe(tmp_path / "glm", "glm4_moe", use_qk_norm=True,
                         partial_rotary_factor=0.25)
    llm = LLM(path, dtype="float32", kv_cache_memory=8 << 20, num_threads=1)
    prompt_ids = [llm.get_tokenizer().encode(p) for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params)
    hf = hf_model(path)
    for ids, out in zip(prompt_ids, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(hf, ids, 32)
    assert llm.engine.runner.model.rotary.cos.shape[-1] == 8  # 32 * 0.25


def with_extra_tensors(tmp_path, source: str, tensors: dict[str, torch.Tensor],
                       **config) -> str:
    """A copy of checkpoint `source` with `tensors` in one more safetensors file and `config`
    entries changed."""
    import json
    import shutil

    from safetensors.torch import save_file

    path = tmp_path / "extra"
    shutil.copytree(source, path)
    save_file(tensors, str(path / "extra.safetensors"))
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, **config}))
    return str(path)


# a multi-token-prediction layer after GLM's 2 decoder layers (a few of its tensors)
MTP_TENSORS = {"model.layers.2.eh_proj.weight": torch.ones(64, 128),
               "model.layers.2.enorm.weight": torch.ones(64),
               "model.layers.2.self_attn.q_proj.weight": torch.ones(128, 64),
               "model.layers.2.mlp.experts.0.gate_proj.weight": torch.ones(32, 64)}


def test_glm_multi_token_prediction_layers_are_skipped_at_load(tmp_path, moe_ckpt):
    """As vLLM without its MTP drafter: num_nextn_predict_layers layers after the last are
    not run and their tensors not loaded; the tokens stay HF's."""
    path = with_extra_tensors(tmp_path, moe_ckpt("glm4_moe"), MTP_TENSORS,
                              num_nextn_predict_layers=1)
    llm = LLM(path, dtype="float32", kv_cache_memory=8 << 20, num_threads=1)
    ids = llm.get_tokenizer().encode(PROMPTS[2])
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": ids}], params)[0]
    assert out.outputs[0].token_ids == hf_greedy(hf_model(moe_ckpt("glm4_moe")), ids, 8)


@pytest.mark.parametrize("tensors, config", [
    (MTP_TENSORS, {"num_nextn_predict_layers": 0}),  # a layer 2 the config does not announce
    ({"model.layers.0.self_attn.indexer.wk.weight": torch.ones(16, 64)}, {}),  # DSA indexer
])
def test_glm_tensors_kiln_does_not_run_fail_at_load_naming_them(tmp_path, moe_ckpt, tensors,
                                                                config):
    from kiln.models.loader import CheckpointError

    path = with_extra_tensors(tmp_path, moe_ckpt("glm4_moe"), tensors, **config)
    with pytest.raises(CheckpointError, match="model.layers.[02].(eh_proj|enorm|self_attn|mlp)"):
        LLM(path, dtype="float32", kv_cache_memory=8 << 20, num_threads=1)
