"""Linear layers with a pluggable weight format (the linear-method seam).

A `Linear` owns no weights itself: its `LinearMethod` creates them, loads checkpoint tensors
into them (one output shard at a time, so q/k/v or gate/up can be fused into one matmul), may
repack them after loading, and computes `y = x W^T + b`. Dense bf16/fp32 weights are one
method; each quantized format (kiln.quant) is another, registered by name.

Contract of a method, in lifecycle order:
  1. `create_weights(layer, in_features, out_shards, bias, dtype)` registers parameters or
     buffers on `layer` (never allocates on a device other than CPU).
  2. `load_shard(layer, shard, name, tensor)` is called once per checkpoint tensor; `shard` is
     the output shard index (0 for unfused layers) and `name` the tensor's suffix in the HF
     checkpoint ("weight", "bias", or a format's own names such as "weight_scale").
  3. `finalize(layer)` runs once after every tensor is loaded (repacking, checks).
  4. `apply(layer, x)` maps [..., in_features] to [..., out_features]; it must not mutate
     `layer` and may be called from any step.
  5. `apply_fp32(layer, x)`: the same product as fp32, from the fp32 sums, never rounded to
     the model dtype: the LM head's logits (a bf16 logit's spacing is 0.0625 at 10, enough to
     tie a prompt's two best candidates and hand greedy decoding the wrong one).
  6. `stack_tensors(layer)` (after `finalize`): the layer's tensors as a fused decoder stack
     reads them (kiln.runner.fused_stack), or None where that stack cannot run this layer;
     the stack then declines and the layers run one call each.
  7. optional, `use_kernels(layer, kernels)` (a kiln.platform.KernelSet), once after the
     model is on its device (`use_kernels` below): a method that picks kernels by platform
     (kiln.quant's int8/fp8 take the Triton GEMV) decides here; one without it ignores it.

Each format registers itself when its module is imported: the dense CPU ones
(`cpu_bf16`, `onednn`) by the loader that picks between them, the quantized ones when kiln.quant
is imported (by the composition root, kiln.assembly; models never import it). This registry
imports none of them.
A sharded linear (tensor parallelism) is one more method: it creates and loads only its rank's
rows or columns, reduces its output through a collective in `apply`, and hands the stack its
format's tensors with the group that reduces them (the stack reduces through the
shared-memory all-reduce only: over gloo, None).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from kiln.kernels.bf16_mm import bf16_linear_fp32
from kiln.platform import KernelSet

if TYPE_CHECKING:
    from kiln.distributed.communicator import ShmCommunicator


@dataclass(frozen=True, eq=False)
class StackTensors:
    """One linear as `kiln::llama_stack` reads it."""

    weight: torch.Tensor  # oneDNN-packed bf16, plain bf16 [out, in], or int8 rows [out, in]
    scale: torch.Tensor  # int8 rows' per-row scales [out, 1]; empty for bf16 weights
    plain_bf16: bool = False  # a plain bf16 weight, for kiln's bf16_gemm (not oneDNN-packed)
    max_tokens: float = math.inf  # the largest step the stack's kernel for it serves
    # the same where the stack's activations are bf16, if that is more (None: the same)
    bf16_max_tokens: float | None = None
    # a row-parallel layer's group: its output is summed over the ranks (inside the stack)
    all_reduce: ShmCommunicator | None = None


NO_SCALE = torch.empty(0, device="cpu")  # StackTensors.scale of a bf16 weight


class LinearMethod(Protocol):
    def create_weights(self, layer: Linear, in_features: int, out_shards: Sequence[int],
                       bias: bool, dtype: torch.dtype) -> None: ...

    def load_shard(self, layer: Linear, shard: int, name: str, tensor: torch.Tensor) -> None: ...

    def finalize(self, layer: Linear) -> None: ...

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor: ...

    def apply_fp32(self, layer: Linear, x: torch.Tensor) -> torch.Tensor: ...

    def stack_tensors(self, layer: Linear) -> StackTensors | None: ...


_METHODS: dict[str, Callable[[], LinearMethod]] = {}


def register_linear_method(name: str) -> Callable:
    """Class decorator: make a LinearMethod constructible by name (e.g. "int8")."""
    def wrap(cls):
        _METHODS[name] = cls
        return cls
    return wrap


def get_linear_method(name: str) -> LinearMethod:
    if name not in _METHODS:
        raise ValueError(f"unknown weight format {name!r}; known: {', '.join(sorted(_METHODS))} "
                         f"(quantized formats register when kiln.quant is imported)")
    return _METHODS[name]()


def available_linear_methods() -> list[str]:
    return sorted(_METHODS)


def shard_rows(out_shards: Sequence[int], shard: int) -> slice:
    start = sum(out_shards[:shard])
    return slice(start, start + out_shards[shard])


@register_linear_method("dense")
class DenseLinearMethod:
    """Plain weights in the model dtype: one [out, in] matrix, shards stacked by rows."""

    def create_weights(self, layer, in_features, out_shards, bias, dtype):
        out = sum(out_shards)
        layer.weight = nn.Parameter(torch.empty(out, in_features, dtype=dtype, device="cpu"),
                                    requires_grad=False)
        layer.bias = (nn.Parameter(torch.zeros(out, dtype=dtype, device="cpu"),
                                   requires_grad=False) if bias else None)

    def load_shard(self, layer, shard, name, tensor):
        target = {"weight": layer.weight, "bias": layer.bias}.get(name)
        if target is None:
            raise ValueError(f"dense linear has no tensor {name!r}")
        rows = shard_rows(layer.out_shards, shard)
        expected = target[rows].shape
        if tuple(tensor.shape) != tuple(expected):
            raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)}, "
                             f"expected {tuple(expected)}")
        with torch.no_grad():
            target[rows].copy_(tensor)

    def finalize(self, layer):
        pass

    def dense_weight(self, layer: Linear) -> torch.Tensor:
        """W [out, in] in the model dtype (methods that repack may rebuild it)."""
        return layer.weight

    def apply(self, layer, x):
        return F.linear(x, layer.weight, layer.bias)

    def apply_fp32(self, layer, x):
        weight = self.dense_weight(layer)
        if weight.dtype == torch.float32:
            return F.linear(x.float(), weight, layer.bias)
        flat = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        out = bf16_linear_fp32(flat, weight) if weight.dtype == torch.bfloat16 else (
            F.linear(flat.float(), weight.float()))
        if layer.bias is not None:
            out = out + layer.bias.float()
        return out if x.dim() == 2 else out.reshape(*x.shape[:-1], out.shape[-1])

    def stack_tensors(self, layer) -> StackTensors | None:
        return None  # torch's matmul: the stack has no kernel for it


class Linear(nn.Module):
    """y = x W^T + b, with W stored however `method` chooses; `out_shards` lists fused outputs."""

    def __init__(self, in_features: int, out_shards: int | Sequence[int], bias: bool = False,
                 dtype: torch.dtype = torch.float32, method: LinearMethod | None = None):
        super().__init__()
        self.in_features = in_features
        self.out_shards = [out_shards] if isinstance(out_shards, int) else list(out_shards)
        self.out_features = sum(self.out_shards)
        self.method = method or DenseLinearMethod()
        self.method.create_weights(self, in_features, self.out_shards, bias, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x)

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_shards}, "
                f"method={type(self.method).__name__}")


def use_kernels(model: nn.Module, kernels: KernelSet) -> None:
    """Tell every linear method of `model` the platform's kernel set (step 7 of the
    contract); the runner calls it once, after moving the model to its device."""
    for module in model.modules():
        if isinstance(module, Linear):
            choose = getattr(module.method, "use_kernels", None)
            if choose is not None:
                choose(module, kernels)
