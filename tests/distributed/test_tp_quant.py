"""Quantized weights split across 2 real rank processes (gloo) against one process, fp32.

One kiln checkpoint holds every group-wise format in a column-parallel (QKV, gate/up) and a
row-parallel (o_proj, down_proj) layer; a dense checkpoint quantized on load checks that
NVFP4's global scale is the whole tensor's, and that activations quantized per block split. (int8 on load: test_tensor_parallel's Qwen2.)

Why not bit for bit: each rank dequantizes exactly one process's weights (the codes and scales
are the same numbers, asserted below), but a row-parallel layer sums two partial products
where one process sums once, so the fp32 outputs differ in the last bits. The bound is the
dense one: identical greedy tokens, prompt logprobs within 1e-4.
"""

from __future__ import annotations

import pytest
import torch

from kiln import LLM, SamplingParams
from kiln.quant.checkpoint import write_checkpoint
from kiln.quant.formats import get_format
from kiln.quant.sharding import columns_of, rows_of

PROMPTS = [[5, 6, 7, 8, 9], list(range(10, 50)), [100, 3, 77, 4]]
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, prompt_logprobs=0)
SETTINGS = dict(dtype="float32", kv_cache_memory=4 << 20, num_threads=1)

# tiny Llama: hidden 64, intermediate 128; at TP=2 o_proj keeps 32 inputs, down_proj 64
MIXED_PLAN = {
    "model.layers.0.self_attn.qkv_proj": "int4-g64-asym",
    "model.layers.0.self_attn.o_proj": "nvfp4",         # 16-blocks; the global scale whole
    "model.layers.0.mlp.gate_up_proj": "mxfp4",
    "model.layers.0.mlp.down_proj": "int4-g64-sym",     # one 64-group per rank and row
    "model.layers.1.self_attn.qkv_proj": "nvfp4",       # a global scale per q/k/v shard
    "model.layers.1.self_attn.o_proj": "int4-g32-asym",  # scales and minimums by group
    "model.layers.1.mlp.gate_up_proj": "fp8",
    "model.layers.1.mlp.down_proj": "mxfp4",
}


def prompt_logprobs(out) -> list[float]:
    return [pos[tid].logprob for pos, tid in zip(out.prompt_logprobs[1:],
                                                 out.prompt_token_ids[1:], strict=True)]


def assert_same(path: str, **settings) -> None:
    one = LLM(path, **SETTINGS, **settings)
    two = LLM(path, **SETTINGS, **settings, tensor_parallel_size=2)
    try:
        reference = one.generate(PROMPTS, GREEDY, use_tqdm=False)
        sharded = two.generate(PROMPTS, GREEDY, use_tqdm=False)
    finally:
        two.close()
    for ref, tp in zip(reference, sharded, strict=True):
        assert tp.outputs[0].token_ids == ref.outputs[0].token_ids
        diffs = [abs(a - b) for a, b in zip(prompt_logprobs(ref), prompt_logprobs(tp),
                                            strict=True)]
        assert max(diffs) < 1e-4


def test_every_group_wise_format_matches_one_process(tiny_ckpt, tmp_path):
    path = write_checkpoint(tiny_ckpt("llama"), tmp_path / "mixed", MIXED_PLAN, "mixed")
    assert_same(str(path))


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4-dyn"])
def test_quantized_on_load_matches_one_process(tiny_ckpt, fmt):
    """nvfp4: the global scale is the whole tensor's; mxfp4-dyn: activations quantized in
    32-blocks, which a row-parallel rank sees whole."""
    assert_same(tiny_ckpt("llama"), quantization=fmt)


@pytest.mark.parametrize("fmt", ["int4-g32-asym", "nvfp4", "mxfp4"])
def test_rank_parts_dequantize_to_one_process_weights(fmt):
    """Each rank's stored tensors decode to exactly its slice of one process's weight."""
    fmt_ = get_format(fmt)
    w = torch.randn(8, 128)
    whole = fmt_.quantize(w)
    reference = fmt_.dequantize(whole)
    for cols in (slice(0, 64), slice(64, 128)):
        part = {k: columns_of(fmt_, k, v, cols) for k, v in whole.items()}
        assert torch.equal(fmt_.dequantize(part), reference[:, cols])
    for rows in (slice(0, 4), slice(4, 8)):
        part = {k: rows_of(fmt_, k, v, rows, 4) for k, v in whole.items()}
        assert torch.equal(fmt_.dequantize(part), reference[rows])


def test_a_size_that_cuts_a_group_fails_with_the_numbers(tiny_ckpt):
    with pytest.raises(ValueError, match="'int4-g64-sym' has groups of 64 inputs: "
                                         "tensor_parallel_size 2 splits a layer's 64 inputs "
                                         "into 32 per rank"):
        LLM(tiny_ckpt("llama"), **SETTINGS, tensor_parallel_size=2, quantization="int4-g64-sym")


def test_a_checkpoint_whose_groups_a_size_cuts_fails_before_ranks_start(tiny_ckpt, tmp_path):
    plan = dict(MIXED_PLAN, **{"model.layers.1.self_attn.o_proj": "int4-g64-asym"})
    path = write_checkpoint(tiny_ckpt("llama"), tmp_path / "g64", plan, "mixed")
    with pytest.raises(ValueError, match="'int4-g64-asym' has groups of 64 inputs: "
                                         "tensor_parallel_size 2 splits a layer's 64 inputs"):
        LLM(str(path), **SETTINGS, tensor_parallel_size=2)


def test_activations_quantized_over_the_whole_row_are_refused(tiny_ckpt):
    with pytest.raises(ValueError, match="'int8-dyn' cannot be split across tensor-parallel "
                                         "ranks: it quantizes activations per token"):
        LLM(tiny_ckpt("llama"), **SETTINGS, tensor_parallel_size=2, quantization="int8-dyn")
