"""How many KV blocks a GPU's memory holds: measured once the weights are loaded, sized by
`gpu_memory_utilization` (vLLM's name).

Kiln may hold `utilization x total` bytes of the card. Of that, what is in use already when the
weights are loaded (`total - free`: the weights, the CUDA context, other processes), and a
reserve for one step's activations, come first; the KV pool takes the rest. The arithmetic is a
pure function (`gpu_kv_blocks`), tested on the CPU with numbers; `measure` is the only part
that asks the GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

GiB = 1 << 30


@dataclass(frozen=True)
class DeviceMemory:
    """A GPU's memory in bytes, read after the weights were loaded onto it."""

    free: int
    total: int
    weights: int  # the model's parameters and buffers (part of total - free)
    activations: int  # kept free for one step's activations (`activation_reserve`)

    @property
    def in_use(self) -> int:
        return self.total - self.free


def gpu_kv_blocks(memory: DeviceMemory, utilization: float, bytes_per_block: int) -> int:
    """KV blocks in what `utilization` of the card leaves after what is in use and the
    activation reserve. ValueError naming the numbers when not one block fits."""
    budget = int(utilization * memory.total) - memory.in_use - memory.activations
    blocks = max(0, budget) // bytes_per_block
    if blocks < 1:
        raise ValueError(
            f"gpu_memory_utilization {utilization} of {_gib(memory.total)} leaves no room for "
            f"the KV cache: {_gib(memory.in_use)} in use already (weights {_gib(memory.weights)})"
            f", {_gib(memory.activations)} kept for activations, one block is "
            f"{bytes_per_block} bytes; raise gpu_memory_utilization or give kv_cache_memory")
    return blocks


def draft_kv_blocks(memory: DeviceMemory, wanted: int, bytes_per_block: int) -> int:
    """A draft model's KV blocks on a GPU, sized after the target took its pool: `wanted`
    (as many tokens as the target's pool holds: a draft mirrors the target's sequences), or
    fewer where the card's free memory, less the draft's activation reserve, holds fewer
    (requests whose draft KV does not fit then get no drafts). ValueError naming the numbers
    when not one block fits."""
    room = memory.free - memory.activations
    blocks = min(wanted, max(0, room) // bytes_per_block)
    if blocks < 1:
        raise ValueError(
            f"no GPU memory left for the draft model's KV cache: {_gib(memory.free)} free after "
            f"the target's pool and the draft's weights ({_gib(memory.weights)}), "
            f"{_gib(memory.activations)} kept for its activations, one block is "
            f"{bytes_per_block} bytes; lower gpu_memory_utilization or give "
            f"draft_kv_cache_memory")
    return blocks


def activation_reserve(hidden: int, intermediate: int, qkv_width: int, vocab: int,
                       tokens: int, logits_rows: int, elem_bytes: int) -> int:
    """Bytes for one step's activations at most: per token the residual stream, a norm's
    fp32 copy, q/k/v, the attention output and the MLP's gate/up and product (twice over, for
    the allocator's slack and tensors alive across a layer), and fp32 logits for the sampled
    rows three times (the logits, their sampling copy, the sampler's noise)."""
    per_token = elem_bytes * (4 * hidden + 2 * qkv_width + 3 * intermediate) + 8 * hidden
    return 2 * tokens * per_token + 3 * 4 * logits_rows * vocab


def model_bytes(model: nn.Module) -> int:
    """Bytes of a model's parameters and buffers."""
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


def measure(device: torch.device, model: nn.Module, activations: int) -> DeviceMemory:
    """The GPU's free and total bytes now (the model loaded on it), via cudaMemGetInfo."""
    free, total = torch.cuda.mem_get_info(device)
    return DeviceMemory(free=free, total=total, weights=model_bytes(model),
                        activations=activations)


def _gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB"
