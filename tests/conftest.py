"""Shared fixtures: tiny random-weight checkpoints of every family, made once per session."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Triton decides interpreted or compiled when it is first imported (its library functions are
# decorated then), and torch._dynamo imports it as soon as any test touches torch.compile: so
# without a GPU the interpreter is switched on here, before any test module is imported
# (tests/kernels/triton run their kernels in it; kiln.kernels.triton does the same at import).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    """Factory: tiny_ckpt(family="llama", **config overrides) -> path (cached per arguments)."""
    from kiln.testing.tiny import make_tiny_checkpoint

    made: dict[tuple, str] = {}

    def make(family: str = "llama", **overrides) -> str:
        key = (family, tuple(sorted(overrides.items())))
        if key not in made:
            path = tmp_path_factory.mktemp(f"tiny-{family}")
            made[key] = str(make_tiny_checkpoint(path, family, **overrides))
        return made[key]

    return make


@pytest.fixture(scope="session")
def llama_path(tiny_ckpt) -> str:
    return tiny_ckpt("llama")


@pytest.fixture(scope="session")
def tiny_llm(llama_path):
    """A shared fp32 LLM on the tiny llama (tests must not rely on its cache state)."""
    from kiln import LLM

    return LLM(llama_path, dtype="float32", kv_cache_memory=8 << 20, num_threads=1)


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
