"""Triton kernel tests: under the interpreter on CPU tensors without a GPU (kiln.kernels.triton
turns it on at import when torch sees no CUDA device, before any kernel is defined), compiled
on "cuda" with one."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
