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
until it has a fused stack of its own. CUDA is one (`--device auto|cpu|cuda`): kiln's Triton
kernels (kiln.kernels.triton) for norms, rotary and attention where triton is installed,
dense weights through torch (cuBLAS), no fused stack; `describe` names the card.
"""

from __future__ import annotations

import enum
import importlib.util
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
    TRITON = "triton"  # kiln's Triton kernels (kiln.kernels.triton): the GPU's norms, rotary


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
    # the dense weight format's choice handed to the loader (kiln.models.loader.dense_method):
    # the config's on the CPU, "torch" on a GPU (cuBLAS; oneDNN packs for CPUs only)
    linear_backend: str = "auto"
    # the GPU's name (torch.cuda.get_device_name), None on the CPU
    gpu: str | None = None

    @classmethod
    def detect(cls, config: ModelConfig) -> Platform:
        """The platform for `config` on this machine: the device `config.device` names
        (auto: CUDA when torch sees a GPU, unless the config names CPU kernels), then that
        device's kernels and backend."""
        cuda = torch.cuda.is_available() and not (config.device == "auto"
                                                  and names_cpu_kernels(config))
        if resolve_device(config.device, cuda) == "cuda":
            # with its index, so that tensors' devices compare equal to it
            return cls.cuda(config, torch.device("cuda", torch.cuda.current_device()))
        return cls.cpu_platform(config)

    @classmethod
    def cpu_platform(cls, config: ModelConfig) -> Platform:
        """The CPU: kiln's C++ kernels where they build (unless `kernels` says torch or
        triton: the latter in Triton's interpreter, for tests), their attention backend with
        them, bf16 for "auto"."""
        kernels = resolve_kernel_set(config.kernels)
        attention = config.attention_backend
        if attention == "auto":
            attention = {KernelSet.CPP: "cpu", KernelSet.TRITON: "triton"}.get(kernels, "torch")
        return cls(device=torch.device("cpu"), dtype=resolve_dtype(config.dtype),
                   kernels=kernels, attention_backend=attention,
                   fused_stack=kernels is KernelSet.CPP and attention == "cpu", cpu=cpu_isa(),
                   linear_backend=config.linear_backend)

    @classmethod
    def cuda(cls, config: ModelConfig, device: torch.device) -> Platform:
        """A CUDA GPU: kiln's Triton kernels for the norms, rotary and attention where triton
        is installed (else the torch references, which run on any device), bf16 for "auto",
        dense weights through torch's matmul (cuBLAS), no fused stack."""
        if config.kernels == "cpp":
            raise ValueError("kernels cpp are kiln's CPU kernels; on a GPU use kernels auto, "
                             "triton or torch (or --device cpu)")
        wants_triton = config.kernels == "triton" or (config.kernels == "auto"
                                                       and triton_available())
        kernels = resolve_kernel_set("triton") if wants_triton else KernelSet.TORCH
        attention = config.attention_backend
        if attention == "auto":
            attention = "triton" if triton_available() else "torch"
        if attention == "cpu":
            raise ValueError("attention_backend cpu runs on the CPU only; on a GPU use auto, "
                             "triton or torch")
        return cls(device=device, dtype=resolve_dtype(config.dtype), kernels=kernels,
                   attention_backend=attention, fused_stack=False, cpu=cpu_isa(),
                   linear_backend="torch", gpu=torch.cuda.get_device_name(device))

    def describe(self) -> str:
        gpu = f" ({self.gpu})" if self.gpu else ""
        return (f"device {self.device}{gpu}, dtype {str(self.dtype).removeprefix('torch.')}, "
                f"kernels {self.kernels.value}, attention {self.attention_backend}, "
                f"fused decoder stack {'on' if self.fused_stack else 'off'}, "
                f"cpu {self.cpu.describe()}")


def resolve_device(name: str, cuda_available: bool) -> str:
    """The device type for a config's `device`: "cpu", "cuda" (a ValueError of one line when
    torch sees no GPU) or "auto" (cuda when torch sees one)."""
    if name == "cuda" and not cuda_available:
        built = torch.version.cuda
        why = (f"torch {torch.__version__} was built without CUDA" if built is None
               else f"torch {torch.__version__} (CUDA {built}) sees no GPU")
        raise ValueError(f"device cuda: {why}; use --device cpu or auto")
    return "cpu" if name == "cpu" or not cuda_available else "cuda"


def names_cpu_kernels(config: ModelConfig) -> bool:
    """Whether the config asks for kernels only the CPU has (so "auto" means the CPU)."""
    return (config.kernels == "cpp" or config.attention_backend == "cpu"
            or config.linear_backend in ("vnni", "onednn", "bf16-fp32"))


def triton_available() -> bool:
    """Whether the triton package and kiln's Triton kernels (kiln.kernels.triton) are there."""
    return (importlib.util.find_spec("triton") is not None
            and importlib.util.find_spec("kiln.kernels.triton") is not None)


def resolve_dtype(name: str) -> torch.dtype:
    """A config dtype name as a torch dtype; "auto" is bf16 (on CPU and GPU: half the bytes that
    decode streams from memory, with bf16 dot products where the CPU has them)."""
    return torch.bfloat16 if name == "auto" else _DTYPES[name]


def resolve_kernel_set(name: str) -> KernelSet:
    """"torch", "triton" (must be installed), "cpp" (must build) or "auto" (kiln's C++
    kernels where they build)."""
    if name == "torch":
        return KernelSet.TORCH
    if name == "triton":
        if not triton_available():
            raise ValueError("kernels triton need the triton package (pip install triton)")
        return KernelSet.TRITON
    from kiln.kernels import cpu as cpu_kernels

    if cpu_kernels.load():
        return KernelSet.CPP
    if name == "cpp":
        raise RuntimeError("the kiln CPU kernels could not be built (see the log)")
    return KernelSet.TORCH
