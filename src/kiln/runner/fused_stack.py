"""The whole decoder stack of a Llama-family model as one C++ call (`kiln::llama_stack`).

The same kernels in the same order as the per-layer path (KernelOps, the linears' own kernels,
CpuPagedAttention), so the same result to the bit, minus one Python round trip per op. The
runner builds a model's `StackWeights` once (`stack_weights`: None where some layer is off this
path) and asks `StackWeights.serves` each step; where it declines, the model's own forward runs
the layers one call each. tests/engine/test_fused_stack.py holds the two paths to each other.

Tensor parallelism: each rank's stack runs its shard (its heads, its qkv and gate_up rows, its
o_proj and down_proj columns) and sums o_proj's and down_proj's outputs over the ranks from
inside the C++ loop, through the shared-memory all-reduce (`StackWeights.all_reduce`), so a
decode step is again one call per rank. Over gloo the stack is off (`stack_weights` None): a
C++ kernel cannot call gloo, and a gloo all-reduce (a few hundred microseconds on loopback,
benchmarks/results/allreduce.json) costs several times the Python calls a layer's stack saves,
so splitting the stack at the reductions would gain little. tests/distributed/
test_tp_fused_stack.py holds the sharded stack to the sharded layers and to one process.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.modules import module as torch_module

from kiln.distributed.communicator import ShmCommunicator
from kiln.models.layers.linear import Linear
from kiln.models.llama import LlamaForCausalLM
from kiln.runner.attention import CpuAttentionMetadata, CpuPagedAttention

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True, eq=False)
class StackWeights:
    """One model's tensors as `kiln::llama_stack` takes them (lists: one entry per layer)."""

    embed: nn.Embedding
    input_norm: list[torch.Tensor]
    qkv: list[torch.Tensor]
    o: list[torch.Tensor]
    post_norm: list[torch.Tensor]
    gate_up: list[torch.Tensor]
    down: list[torch.Tensor]
    # per-row scales of int8 rows, per projection; empty lists where every layer is bf16
    qkv_scale: list[torch.Tensor]
    o_scale: list[torch.Tensor]
    gate_up_scale: list[torch.Tensor]
    down_scale: list[torch.Tensor]
    final_norm: torch.Tensor
    cos32: torch.Tensor  # [max_pos, D] fp32 rotary tables
    sin32: torch.Tensor
    scale: float  # attention's 1 / sqrt(D)
    eps: float
    num_heads: int
    num_kv_heads: int
    head_dim: int
    plain_bf16: bool  # bf16 weights through kiln's bf16_gemm, not oneDNN-packed
    long_ok: bool  # long prefill chunks through the C++ prefill kernel (bf16, D 64 or 128)
    max_tokens: float  # the largest step the stack serves (its linears' kernels' limit)
    # the hook registries of every module the stack bypasses (the same dicts for the model's
    # lifetime: registering or removing a hook edits them in place), so the per-step check
    # is one any() over them
    hook_dicts: list[dict]
    # tensor parallelism: the group that sums o_proj's and down_proj's outputs inside the
    # stack; None in one process
    all_reduce: ShmCommunicator | None = None

    def serves(self, meta: CpuAttentionMetadata) -> bool:
        """Whether this step can run as one call: every chunk's attention within the C++
        kernels, no more tokens than the linears' kernels take, and no hooks to honour
        (speculator heads, scoring and GPTQ attach them)."""
        if meta.long is not None and not self.long_ok:
            return False
        if meta.num_tokens > self.max_tokens:
            return False
        return not (_global_hooks() or any(self.hook_dicts))

    def layer_args(self) -> tuple:
        """`kiln::llama_stack`'s arguments from input_norm to sin32, in its order."""
        return (self.input_norm, self.qkv, self.o, self.post_norm, self.gate_up, self.down,
                self.qkv_scale, self.o_scale, self.gate_up_scale, self.down_scale,
                self.final_norm, self.cos32, self.sin32)


def _global_hooks() -> bool:
    return bool(torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks)


def stack_weights(model: LlamaForCausalLM, backend: CpuPagedAttention) -> StackWeights | None:
    """The model's `StackWeights`, or None when a layer is off the fused path: q/k norms, a
    feed-forward other than a dense MLP (a mixture of experts), or a linear whose method has
    no stack tensors (a bias, torch's matmul, a format other than oneDNN bf16, kiln's
    bf16-fp32 and weight-only int8)."""
    layers = list(model.model.layers)
    mlp = [layer.dense_mlp() for layer in layers]
    if None in mlp:
        return None  # a mixture-of-experts block: the stack has no routing
    attn = [layer.self_attn for layer in layers]
    projections = {"qkv": [a.qkv_proj for a in attn], "o": [a.o_proj for a in attn],
                   "gate_up": [f.gate_up_proj for f in mlp], "down": [f.down_proj for f in mlp]}
    linears = [m for ms in projections.values() for m in ms]
    stored = {m: m.method.stack_tensors(m) for m in linears}
    if model.arch.qk_norm or None in stored.values():
        return None
    row = {stored[m].all_reduce for m in projections["o"] + projections["down"]}
    column = {stored[m].all_reduce for m in projections["qkv"] + projections["gate_up"]}
    if column != {None} or len(row) != 1 or (None in row) != (model.tp.size == 1):
        return None  # the stack would not sum the outputs the layers sum (over gloo: none)
    (all_reduce,) = row
    int8 = any(t.scale.numel() for t in stored.values())
    weights = {name: [stored[m].weight for m in ms] for name, ms in projections.items()}
    scales = {f"{name}_scale": [stored[m].scale for m in ms] if int8 else []
              for name, ms in projections.items()}
    a, norm = model.arch, model.model.norm
    embed = model.model.embed_tokens
    return StackWeights(
        embed=embed, **weights, **scales,
        input_norm=[layer.input_layernorm.weight for layer in layers],
        post_norm=[layer.post_attention_layernorm.weight for layer in layers],
        final_norm=norm.weight, cos32=model.rotary.cos32, sin32=model.rotary.sin32,
        scale=a.head_dim ** -0.5, eps=norm.eps, num_heads=attn[0].num_heads,
        num_kv_heads=attn[0].num_kv_heads, head_dim=a.head_dim,
        plain_bf16=any(t.plain_bf16 for t in stored.values()),
        long_ok=(backend.bf16_prefill and a.head_dim in (64, 128)
                 and embed.weight.dtype == torch.bfloat16),
        max_tokens=min((t.max_tokens for t in stored.values()), default=math.inf),
        hook_dicts=[d for m in [model] + layers + attn + mlp + linears
                    for d in (m._forward_hooks, m._forward_pre_hooks)],
        all_reduce=all_reduce)


def fused_stack(w: StackWeights, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: KVCaches, meta: CpuAttentionMetadata) -> torch.Tensor:
    """Final hidden states [T, H] of every decoder layer and the final norm in one call to
    `kiln::llama_stack` (KV written), as the model's forward computes them. Tensor
    parallelism: a collective (the embedding's all-reduce, then two per layer inside the
    call); a rank that does not arrive makes it raise RankFailure after the group's timeout."""
    args = (w.embed(input_ids), positions, *w.layer_args(), [k for k, _ in kv_caches],
            [v for _, v in kv_caches], *stack_attention_args(meta), w.scale, w.eps,
            w.num_heads, w.num_kv_heads, w.head_dim, w.plain_bf16)
    if w.all_reduce is None:
        return torch.ops.kiln.llama_stack(*args)
    return w.all_reduce.reduce_inside(
        lambda segment, rank, timeout_s: torch.ops.kiln.llama_stack(*args, segment, rank,
                                                                    timeout_s),
        "fused decoder stack's all-reduce")


def stack_attention_args(meta: CpuAttentionMetadata) -> tuple:
    """`kiln::llama_stack`'s attention arguments from the cpu backend's metadata: the slot
    mapping, the short queries' layout (with its tree bits), the long ones', the block size."""
    short, long = meta.short, meta.long
    none4 = (None, None, None, None)
    short_args = ((short.block_table, short.query_start, short.query_lens, short.context_lens,
                   short.tree_mask) if short is not None else (*none4, None))
    long_args = ((long.block_table, long.query_start, long.query_lens, long.context_lens)
                 if long is not None else none4)
    return (meta.slot_mapping, *short_args, *long_args, meta.block_size)


def stack_linear_tensors(m: Linear) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(weight, scale) of one linear as `kiln::llama_stack` reads it, or None (for
    kiln.speculative.head, which packs its one layer itself)."""
    t = m.method.stack_tensors(m)
    return None if t is None else (t.weight, t.scale)
