"""The device seam: where the model runs and which kernels run it, decided once at start.

A `Platform` answers every question that used to be asked of a kernel-set name at run time:
the device every tensor is created on, what dtype "auto" means there, which op implementations
the model calls (the torch reference or kiln's fused C++ kernels), which attention backend the
runner builds, and whether the runner may run the whole decoder stack as one fused call.
`Platform.detect(model_config)` decides it from the config and what this machine can build,
and records the CPU's model and instruction sets (kiln.kernels.isa), which the runner logs
once at start.

A new device plugs in here: a `detect` branch that returns its device, its kernel set and the
name of its attention backend (registered in kiln.runner.attention), with `fused_stack` off
until it has a fused stack of its own.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass

import torch

from kiln.config import ModelConfig
from kiln.kernels.isa import CpuIsa, cpu_isa

log = logging.getLogger(__name__)


class KernelSet(enum.Enum):
    """Which implementations of the model's elementwise ops (norms, SiLU, rotary) run."""

    TORCH = "torch"  # plain torch: the reference every kernel is tested against
    CPP = "cpp"  # kiln's fused C++ CPU kernels (kiln.kernels.cpu)


_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(frozen=True)
class Platform:
    device: torch.device
    dtype: torch.dtype  # weights, activations and the KV cache
    kernels: KernelSet
    attention_backend: str  # a name registered in kiln.runner.attention
    # the runner may run every decoder layer as one `kiln::llama_stack` call
    # (kiln.runner.fused_stack) where the model's weights allow it
    fused_stack: bool
    # the CPU's model and instruction sets (kiln.kernels.isa), read once per process
    cpu: CpuIsa

    @classmethod
    def detect(cls, config: ModelConfig) -> Platform:
        """The platform for `config` on this machine (CPU): kiln's kernels where they build
        (unless `kernels` says torch), their attention backend with them, bf16 for "auto"."""
        kernels = resolve_kernel_set(config.kernels)
        attention = config.attention_backend
        if attention == "auto":
            attention = "cpu" if kernels is KernelSet.CPP else "torch"
        return cls(device=torch.device("cpu"), dtype=resolve_dtype(config.dtype),
                   kernels=kernels, attention_backend=attention,
                   fused_stack=kernels is KernelSet.CPP and attention == "cpu", cpu=cpu_isa())

    def describe(self) -> str:
        return (f"device {self.device}, dtype {str(self.dtype).removeprefix('torch.')}, "
                f"kernels {self.kernels.value}, attention {self.attention_backend}, "
                f"fused decoder stack {'on' if self.fused_stack else 'off'}, "
                f"cpu {self.cpu.describe()}")


def resolve_dtype(name: str) -> torch.dtype:
    """A config dtype name as a torch dtype; "auto" is bf16 (on CPU: half the bytes that
    decode streams from memory, with bf16 dot products where the CPU has them)."""
    return torch.bfloat16 if name == "auto" else _DTYPES[name]


def resolve_kernel_set(name: str) -> KernelSet:
    """"torch", "cpp" (must build) or "auto" (kiln's kernels where they build)."""
    if name == "torch":
        return KernelSet.TORCH
    from kiln.kernels import cpu as cpu_kernels

    if cpu_kernels.load():
        return KernelSet.CPP
    if name == "cpp":
        raise RuntimeError("the kiln CPU kernels could not be built (see the log)")
    return KernelSet.TORCH
