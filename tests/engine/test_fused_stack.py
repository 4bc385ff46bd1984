"""The whole decoder stack as one C++ call (`kiln::llama_stack`) against the per-layer path."""

from __future__ import annotations

import pytest
import torch

from kiln import LLM, SamplingParams
from kiln.kernels import cpu as cpu_kernels
from kiln.runner import fused_stack

pytestmark = pytest.mark.skipif(not cpu_kernels.load(), reason="kiln CPU kernels did not build")

PROMPTS = [list(range(3, 3 + n)) for n in (5, 40, 90, 17)]  # short and long prefill chunks


def tiny_llm(tiny_ckpt, **kwargs):
    # head dim 64 (hidden 256 / 4 heads), so long chunks can use the C++ prefill kernel too
    path = tiny_ckpt("llama", hidden_size=256, intermediate_size=512, num_hidden_layers=3)
    return LLM(path, dtype="bfloat16", kv_cache_memory=16 << 20, num_threads=2, **kwargs)


@pytest.fixture(scope="module")
def llm(tiny_ckpt):
    return tiny_llm(tiny_ckpt)


@pytest.fixture(scope="module")
def layered_llm(tiny_ckpt):
    llm = tiny_llm(tiny_ckpt)
    llm.engine.runner.stack = None  # None: never fused
    return llm


def run(llm, monkeypatch, calls: list, prompts: list[list[int]] = PROMPTS) -> list:
    """Greedy with logprobs on fresh prompts, then again after their cached prefixes."""
    real = fused_stack.fused_stack

    def counted(*args):
        calls.append(args[1].shape[0])
        return real(*args)

    monkeypatch.setattr(fused_stack, "fused_stack", counted)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    outs += llm.generate([{"prompt_token_ids": p + [7, 8, 9]} for p in prompts], params)
    return [(o.outputs[0].token_ids, [[(t, lp.logprob) for t, lp in sorted(step.items())]
                                      for step in o.outputs[0].logprobs]) for o in outs]


def test_fused_stack_is_bit_identical_to_the_layer_path(llm, layered_llm, monkeypatch):
    stack = llm.engine.runner.stack
    if stack is None:
        pytest.skip("this machine's model is not on the fast path")
    fused_calls, layer_calls = [], []
    fused = run(llm, monkeypatch, fused_calls)
    layered = run(layered_llm, monkeypatch, layer_calls)
    assert layer_calls == [] and len(PROMPTS) in fused_calls  # decode steps fused
    if stack.max_tokens > max(len(p) for p in PROMPTS):  # oneDNN: prefill fused too
        assert max(fused_calls) > len(PROMPTS)
    assert max(fused_calls) <= stack.max_tokens
    assert fused == layered  # tokens and logprobs, exactly


def test_bf16_fp32_weights_fuse_on_decode_steps_only(tiny_ckpt, monkeypatch):
    """bf16 weights with fp32 arithmetic (kiln's bf16_gemm, the default on CPUs without bf16
    instructions; forced here so every machine runs it) inside the stack on decode-sized
    steps, prefill layer by layer, with the same bits as the per-layer path."""
    from kiln.kernels.bf16_mm import BF16_GEMM_MAX_TOKENS

    fused_llm = tiny_llm(tiny_ckpt, linear_backend="bf16-fp32")
    stack = fused_llm.engine.runner.stack
    assert stack.plain_bf16 and stack.max_tokens == BF16_GEMM_MAX_TOKENS
    layered_llm = tiny_llm(tiny_ckpt, linear_backend="bf16-fp32")
    layered_llm.engine.runner.stack = None
    fused_calls, layer_calls = [], []
    fused = run(fused_llm, monkeypatch, fused_calls)
    layered = run(layered_llm, monkeypatch, layer_calls)
    assert layer_calls == [] and len(PROMPTS) in fused_calls
    assert max(fused_calls) <= BF16_GEMM_MAX_TOKENS
    assert fused == layered


def test_hooks_turn_the_fused_path_off(tiny_ckpt, monkeypatch):
    llm = tiny_llm(tiny_ckpt)
    model = llm.engine.runner.model
    if llm.engine.runner.stack is None:
        pytest.skip("this machine's model is not on the oneDNN fast path")
    seen = []
    handle = model.model.layers[1].mlp.down_proj.register_forward_hook(
        lambda _m, _a, out: seen.append(out.shape[0]))
    calls: list = []
    try:
        run(llm, monkeypatch, calls)
    finally:
        handle.remove()
    assert calls == [] and seen  # every step went layer by layer, so the hook saw them all
    run(llm, monkeypatch, calls)
    assert calls


def test_reference_ops_never_fuse(tiny_ckpt):
    path = tiny_ckpt("llama", hidden_size=256, intermediate_size=512, num_hidden_layers=3)
    llm = LLM(path, dtype="bfloat16", kv_cache_memory=16 << 20, num_threads=1, kernels="torch")
    assert llm.engine.runner.stack is None
    fp32 = LLM(path, dtype="float32", kv_cache_memory=16 << 20, num_threads=1)
    assert fp32.engine.runner.stack is None


def test_int8_weights_fuse_on_decode_steps_only(tiny_ckpt, monkeypatch):
    """Weight-only int8 layers run kiln's int8 GEMV inside the stack on decode-sized steps
    (prefill steps go layer by layer) with the same bits as the per-layer path."""
    fused_llm = tiny_llm(tiny_ckpt, quantization="int8")
    if fused_llm.engine.runner.stack is None:
        pytest.skip("this machine's model is not on the fast path")
    layered_llm = tiny_llm(tiny_ckpt, quantization="int8")
    layered_llm.engine.runner.stack = None
    fused_calls, layer_calls = [], []
    fused = run(fused_llm, monkeypatch, fused_calls)
    layered = run(layered_llm, monkeypatch, layer_calls)
    assert layer_calls == [] and fused_calls
    assert max(fused_calls) <= fused_llm.engine.runner.stack.max_tokens
    assert fused == layered


def test_draft_trees_fuse_with_the_same_bits(tiny_ckpt, monkeypatch):
    """n-gram draft trees (their attention bits go into the stack's paged attention) give the
    fused and the per-layer path the same tokens and logprobs."""
    import kiln.runner.batch as batch
    from kiln.config_speculative import SpeculativeConfig

    spec = SpeculativeConfig(adaptive=False, tree_width=3, tree_max_batch=8)
    fused_llm = tiny_llm(tiny_ckpt, speculator="ngram", speculative_config=spec)
    if fused_llm.engine.runner.stack is None:
        pytest.skip("this machine's model is not on the fast path")
    layered_llm = tiny_llm(tiny_ckpt, speculator="ngram", speculative_config=spec)
    layered_llm.engine.runner.stack = None
    trees = []
    real = batch._place_tree
    monkeypatch.setattr(batch, "_place_tree", lambda item, *a: trees.append(
        item.num_draft_tokens) or real(item, *a))
    fused_calls, layer_calls = [], []
    # every token of the tiny vocabulary twice, with different successors: whatever the
    # model samples, its lookup finds two continuations (a tree)
    vocab = fused_llm.engine.runner.model.arch.vocab_size
    prompts = [*PROMPTS, list(range(3, vocab)) + list(range(vocab - 1, 2, -2))]
    fused = run(fused_llm, monkeypatch, fused_calls, prompts)
    layered = run(layered_llm, monkeypatch, layer_calls, prompts)
    assert layer_calls == [] and fused_calls and trees
    assert fused == layered


def test_qwen3_q_k_norms_fuse_with_the_same_bits(tiny_ckpt, monkeypatch):
    """Qwen3's per-head q/k RMS norms run inside the stack (the per-layer path's kernel),
    prefill and decode, with the same tokens and logprobs as the per-layer path."""
    path = tiny_ckpt("qwen3", hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                     head_dim=64)

    def make():
        return LLM(path, dtype="bfloat16", kv_cache_memory=16 << 20, num_threads=2)

    fused_llm, layered_llm = make(), make()
    stack = fused_llm.engine.runner.stack
    if stack is None:
        pytest.skip("this machine's model is not on the fast path")
    assert len(stack.q_norm) == len(stack.k_norm) == 3
    layered_llm.engine.runner.stack = None
    fused_calls, layer_calls = [], []
    fused = run(fused_llm, monkeypatch, fused_calls)
    layered = run(layered_llm, monkeypatch, layer_calls)
    assert layer_calls == [] and len(PROMPTS) in fused_calls
    assert fused == layered


def tiny_moe_llm(tmp_path_factory, model_type: str, quantization: str | None = None,
                 **overrides):
    from tests.parity.test_moe_parity import make_tiny_moe

    path = make_tiny_moe(tmp_path_factory.mktemp(model_type), model_type, hidden_size=256,
                         num_hidden_layers=3, **overrides)
    make = lambda: LLM(path, dtype="bfloat16", kv_cache_memory=16 << 20,  # noqa: E731
                       num_threads=2, quantization=quantization)
    return make(), make()


@pytest.mark.parametrize("model_type, overrides, quantization", [
    ("qwen3_moe", {"head_dim": 64, "mlp_only_layers": [1]}, None),  # q/k norms, a dense layer
    ("mixtral", {}, None),  # 8 experts: the router's packed copy is half a block
    ("qwen3_moe", {"head_dim": 64, "mlp_only_layers": [1]}, "int8"),
])
def test_sparse_blocks_fuse_on_decode_steps_with_the_same_bits(tmp_path_factory, monkeypatch,
                                                               model_type, overrides,
                                                               quantization):
    """Softmax-routed sparse blocks on bf16 (or int8) VNNI experts run inside the stack
    (router, counters and the fused expert kernel) on the steps the fused expert kernel
    serves; longer prefill steps go layer by layer; tokens, logprobs and the routed-pair
    counters equal the per-layer path's."""
    fused_llm, layered_llm = tiny_moe_llm(tmp_path_factory, model_type, quantization,
                                          **overrides)
    stack = fused_llm.engine.runner.stack
    if stack is None:
        pytest.skip("this machine's experts are not on the fused kernel (AVX512-BF16, "
                    "AVX512-VNNI for int8)")
    expert_dtype = torch.uint8 if quantization == "int8" else torch.bfloat16
    assert stack.gate_up[0].dtype == stack.down[2].dtype == expert_dtype
    assert all(r.dim() == 4 for r in stack.router if r is not None)  # Router.pack's copies
    sparse = [r is not None for r in stack.router]
    assert sparse == ([True, False, True] if model_type == "qwen3_moe" else [True] * 3)
    layered_llm.engine.runner.stack = None
    fused_calls, layer_calls = [], []
    fused = run(fused_llm, monkeypatch, fused_calls)
    layered = run(layered_llm, monkeypatch, layer_calls)
    assert layer_calls == [] and len(PROMPTS) in fused_calls
    limit = min(e.fused_max_tokens for e in stack.experts)  # the expert kernel's
    assert max(fused_calls) <= limit < max(len(p) for p in PROMPTS)
    assert fused == layered

    def counters(llm):
        blocks = [layer.sparse_moe() for layer in llm.engine.runner.model.model.layers]
        return [b.expert_tokens.tolist() for b in blocks if b is not None]

    assert counters(fused_llm) == counters(layered_llm)
    assert all(e.fused_steps for e in stack.experts)


@pytest.mark.parametrize("model_type", ["qwen2_moe", "glm4_moe"])
def test_blocks_the_stack_does_not_route_keep_the_layer_path(tmp_path_factory, model_type):
    """A shared expert (Qwen2-MoE) or DeepSeek's sigmoid router (GLM-4.5) is no block of the
    stack's: the whole model keeps the per-layer path."""
    from tests.parity.test_moe_parity import make_tiny_moe

    path = make_tiny_moe(tmp_path_factory.mktemp(model_type), model_type, hidden_size=256,
                         head_dim=64)
    llm = LLM(path, dtype="bfloat16", kv_cache_memory=16 << 20, num_threads=1)
    blocks = [b for b in (layer.sparse_moe() for layer in llm.engine.runner.model.model.layers)
              if b is not None]
    if model_type == "qwen2_moe":
        assert blocks and not any(fused_stack.stack_moe(b) for b in blocks)
    else:
        assert blocks == []  # GLM's layers decline the stack themselves (partial rotary)
    assert llm.engine.runner.stack is None
