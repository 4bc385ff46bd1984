"""Device selection (`--device auto|cpu|cuda`) and the GPU's settings, on the CPU: what auto
resolves to, the one-line error for a GPU torch cannot see, the flags the CLI makes, and that
an engine built and run with `meta` as torch's default device gives the same tokens (every
tensor kiln creates names its device, so the same code places everything on a GPU)."""

from __future__ import annotations

import argparse

import pytest
import torch

from kiln.config import CacheConfig, ModelConfig
from kiln.config_cli import add_flags
from kiln.platform import Platform, resolve_device

NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")


@pytest.mark.parametrize(("name", "cuda", "expected"), [
    ("auto", False, "cpu"), ("auto", True, "cuda"), ("cpu", True, "cpu"), ("cpu", False, "cpu"),
    ("cuda", True, "cuda")])
def test_resolve_device(name, cuda, expected):
    assert resolve_device(name, cuda) == expected


def test_cpu_kernels_keep_auto_on_the_cpu():
    from kiln.platform import names_cpu_kernels

    assert not names_cpu_kernels(ModelConfig())
    assert not names_cpu_kernels(ModelConfig(kernels="triton", attention_backend="torch"))
    for settings in ({"kernels": "cpp"}, {"attention_backend": "cpu"},
                     {"linear_backend": "onednn"}, {"linear_backend": "bf16-fp32"}):
        assert names_cpu_kernels(ModelConfig(**settings)), settings


def test_cuda_without_a_gpu_is_one_clear_line():
    with pytest.raises(ValueError) as err:
        resolve_device("cuda", False)
    message = str(err.value)
    assert "\n" not in message and message.startswith("device cuda: torch ")
    assert "--device cpu" in message


@NO_CUDA
def test_platform_detect_on_a_cpu_machine():
    platform = Platform.detect(ModelConfig(model="unused", kernels="torch"))
    assert platform.device == torch.device("cpu") and platform.gpu is None
    assert platform.attention_backend == "torch" and platform.linear_backend == "auto"
    with pytest.raises(ValueError, match="^device cuda: "):
        Platform.detect(ModelConfig(model="unused", device="cuda"))


@NO_CUDA
def test_cli_device_cuda_without_a_gpu_exits_with_one_line(llama_path, capsys):
    """`kiln generate --device cuda` on this machine: a nonzero status and the message."""
    from kiln.cli import main

    status = main(["generate", "--model", llama_path, "--device", "cuda", "--max-tokens", "1"])
    err = capsys.readouterr().err
    assert status != 0 and "device cuda: torch" in err and "Traceback" not in err


def test_gpu_settings_are_validated_and_flags():
    with pytest.raises(ValueError, match="device must be one of auto, cpu, cuda"):
        ModelConfig(device="tpu")
    for bad in (0.0, 1.5, -0.1):
        with pytest.raises(ValueError, match=f"gpu_memory_utilization must be in \\(0, 1\\], "
                                             f"got {bad}"):
            CacheConfig(gpu_memory_utilization=bad)
    assert CacheConfig().gpu_memory_utilization == 0.9 and not ModelConfig().enforce_eager
    parser = argparse.ArgumentParser()
    add_flags(parser, ModelConfig)
    add_flags(parser, CacheConfig)
    args = parser.parse_args(["--device", "cuda", "--enforce-eager",
                              "--gpu-memory-utilization", "0.5"])
    assert (args.device, args.enforce_eager, args.gpu_memory_utilization) == ("cuda", True, 0.5)


def test_an_engine_on_the_meta_default_device_gives_the_same_tokens(llama_path):
    """Built and run with torch's default device set to `meta`: a tensor created without a
    device would land there and fail (or change the tokens)."""
    from kiln import LLM, SamplingParams
    from kiln.assembly import register_plugins

    prompts = ["The quick brown fox", "Paris is the capital"]
    params = [SamplingParams(max_tokens=4, temperature=0),
              SamplingParams(max_tokens=4, temperature=0.8, top_p=0.9, seed=3,
                             repetition_penalty=1.1)]

    def run() -> list[list[int]]:
        llm = LLM(llama_path, dtype="float32", kv_cache_memory=2 << 20, num_threads=1,
                  attention_backend="torch", kernels="torch")
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    expected = run()
    register_plugins()  # import-time tables of the plugins are built before the switch
    torch.set_default_device("meta")
    try:
        assert run() == expected
    finally:
        torch.set_default_device("cpu")


@NO_CUDA
def test_triton_kernels_on_the_cpu_are_the_interpreters_choice():
    """kernels="triton" is a test mode on the CPU (Triton's interpreter): the Triton ops and,
    with them, the triton attention backend."""
    pytest.importorskip("triton")
    pytest.importorskip("kiln.kernels.triton")
    from kiln.models.layers.ops import TritonOps, ops_for
    from kiln.platform import KernelSet

    platform = Platform.detect(ModelConfig(model="unused", kernels="triton"))
    assert platform.kernels is KernelSet.TRITON and platform.attention_backend == "triton"
    assert not platform.fused_stack and isinstance(ops_for(platform.kernels), TritonOps)
