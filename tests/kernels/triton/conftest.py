"""Triton kernel tests: under the interpreter on CPU tensors without a GPU (kiln.kernels.triton
turns it on at import when torch sees no CUDA device, before any kernel is defined), compiled
on "cuda" with one."""

from __future__ import annotations

import importlib.util
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

if importlib.util.find_spec("triton") is None:  # not installed off Linux (pyproject.toml)
    collect_ignore_glob = ["test_*.py"]
