"""Engines on the Triton kernel set, in Triton's interpreter on the CPU (the GPU's twins:
tests/gpu/test_quant_spec_cuda.py): int8/fp8 checkpoints written by kiln's quantizer give the
torch path's greedy tokens with the Triton GEMV serving their decode steps; a draft model (its
runner, int8 weights and KV pool on the target's platform) and an EAGLE-style head give the
tokens without speculation. And a head packed for a platform holds every tensor on that
platform's device (`meta` here, standing in for a GPU: nothing left on the CPU passes)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("triton")
pytest.importorskip("kiln.kernels.triton")

from kiln.config import ModelConfig  # noqa: E402
from kiln.config_speculative import SpeculativeConfig  # noqa: E402
from kiln.kernels.triton import INTERPRETED, quant_gemv  # noqa: E402
from kiln.platform import Platform  # noqa: E402

INTERPRETER_ONLY = pytest.mark.skipif(not INTERPRETED, reason="the engines run on CPU tensors")


@pytest.fixture
def gemv_calls(monkeypatch) -> list[int]:
    """Rows of each call to the real quant_gemv.weight_only_gemv, recorded on the way in."""
    calls: list[int] = []
    real = quant_gemv.weight_only_gemv

    def counted(x, weight, scale, out=None):
        calls.append(x.shape[0])
        return real(x, weight, scale, out)

    monkeypatch.setattr(quant_gemv, "weight_only_gemv", counted)
    return calls


@pytest.fixture(scope="module")
def quantized_checkpoints(llama_path, tmp_path_factory) -> dict[str, str]:
    """The tiny llama as kiln's quantizer writes it, int8 and fp8 (every linear but the
    tied LM head)."""
    from kiln.quant.checkpoint import write_checkpoint
    from kiln.quant.pipeline import Reference, uniform_plan

    shapes = Reference(llama_path).shapes()
    root = tmp_path_factory.mktemp("quantized")
    return {fmt: str(write_checkpoint(llama_path, root / fmt, uniform_plan(shapes, fmt), fmt))
            for fmt in ("int8", "fp8")}


@INTERPRETER_ONLY
@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_quantized_engine_on_triton_gives_the_torch_tokens(quantized_checkpoints, fmt,
                                                           gemv_calls):
    from kiln import LLM, SamplingParams

    prompts = ["The quick brown fox", "def add(a, b):"]
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)

    def run(kernels: str) -> list[list[int]]:
        llm = LLM(quantized_checkpoints[fmt], dtype="float32", kv_cache_memory=1 << 20,
                  num_threads=1, kernels=kernels, attention_backend="torch")
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    expected = run("torch")
    assert not gemv_calls
    assert run("triton") == expected
    # 4 linears a layer, 2 layers: every decode step's rows went through the kernel
    decode_calls = [rows for rows in gemv_calls if rows <= 2]
    assert len(decode_calls) >= 8 * 4


SPEC = SpeculativeConfig(num_speculative_tokens=2, adaptive=False, ngram_first=False,
                         tree_width=1)


def meta_platform() -> Platform:
    """The Triton platform with its tensors on `meta`: a device that is not the CPU."""
    cpu = Platform.detect(ModelConfig(model="unused", kernels="triton"))
    return dataclasses.replace(cpu, device=torch.device("meta"))


@pytest.fixture(scope="module")
def draft_path(tiny_ckpt) -> str:
    return tiny_ckpt("llama", num_hidden_layers=1)


@pytest.fixture(scope="module")
def head_path(llama_path, tmp_path_factory) -> str:
    """An untrained head (random drafts: rejections and rollbacks all the time)."""
    from kiln.models.loader import read_hf_config
    from kiln.models.registry import resolve_architecture
    from kiln.speculative.head.model import EagleHead, HeadConfig, save_head

    _, arch = resolve_architecture(read_hf_config(llama_path))
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("head")
    save_head(EagleHead(HeadConfig.for_target(arch, 256, (0, -1))), out, torch.float32)
    return str(out)


@INTERPRETER_ONLY
@pytest.mark.parametrize("proposer", ["draft", "head"])
def test_speculation_on_triton_gives_the_tokens_without_it(llama_path, draft_path, head_path,
                                                          proposer, gemv_calls):
    from kiln import LLM, SamplingParams

    prompts = ["The quick brown fox jumps over the lazy dog. The quick", "def add(a, b):"]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)

    def run(**spec) -> tuple[LLM, list[list[int]]]:
        llm = LLM(llama_path, dtype="float32", kv_cache_memory=1 << 20, num_threads=1,
                  kernels="triton", **spec)
        return llm, [o.outputs[0].token_ids for o in llm.generate(prompts, params,
                                                                   use_tqdm=False)]

    _, expected = run()
    assert not gemv_calls  # a dense target
    speculator = {"draft": draft_path, "head": head_path}[proposer]
    llm, tokens = run(speculator=speculator, speculative_config=SPEC)
    assert tokens == expected
    assert llm.engine.speculator.stats.num_draft_tokens > 0
    assert gemv_calls  # the draft's or head's int8 decode steps, through the Triton GEMV
    if proposer == "head":
        return
    runner = llm.engine.speculator.proposer.runner
    assert llm.engine.speculator.proposer.int8
    assert runner.platform.kernels is llm.engine.runner.platform.kernels
    tensors = [*runner.model.parameters(), *runner.model.buffers(),
               *(t for kv in runner.kv_caches for t in kv)]
    assert {t.device for t in tensors} == {llm.engine.runner.device}


def test_a_head_packed_for_a_platform_holds_every_tensor_on_its_device():
    from kiln.models.layers.ops import TorchOps
    from kiln.speculative.head.model import (
        EagleHead,
        HeadConfig,
        SmallBatchInt8,
        pack_for_inference,
        packed_linear,
    )

    c = HeadConfig(hidden_size=64, intermediate_size=96, num_heads=4, num_kv_heads=2,
                   head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None,
                   max_position_embeddings=64, vocab_size=100, draft_vocab_size=100,
                   feature_layers=(0, -1))
    platform = meta_platform()
    head = pack_for_inference(EagleHead(c).eval().requires_grad_(False), TorchOps(),
                              int8=True, platform=platform)
    tensors = dict(head.named_parameters()) | dict(head.named_buffers())
    assert {"draft_vocab", "layer.fused.0.int8.weight", "fuse.int8.weight_scale",
            "layer.fused.1.dense.weight", "norm"} <= set(tensors)
    assert {name for name, t in tensors.items() if t.device.type != "meta"} == set()
    # the int8 copies serve what the Triton GEMV serves
    assert all(m.max_rows == quant_gemv.MAX_ROWS for m in head.modules()
               if isinstance(m, SmallBatchInt8))
    lm = packed_linear(torch.randn(30, 64), int8=True, platform=platform)
    assert {t.device.type for t in [*lm.parameters(), *lm.buffers()]} == {"meta"}
