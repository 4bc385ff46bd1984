"""The whole decoder stack of a Llama-family model as one C++ call (`kiln::llama_stack`).

The same kernels in the same order as the per-layer path (KernelOps, the linears' own kernels,
CpuPagedAttention; Qwen3's q/k norms through KernelOps' kernel; a softmax-routed sparse block
through its Python router's ops and the fused expert kernel, bf16 or int8, `stack_moe`), so the
same result to the bit, minus one Python round trip per op. The
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
from kiln.kernels.moe_experts import ExpertFormat, StackedExperts
from kiln.models.layers.experts import FusedExperts
from kiln.models.layers.linear import NO_SCALE, Linear, StackTensors
from kiln.models.layers.moe import SparseMoeBlock
from kiln.models.layers.moe_router import Scoring
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
    gate_up: list[torch.Tensor]  # a sparse layer's: its stacked experts' (`router`)
    down: list[torch.Tensor]
    # per-row scales of int8 rows, per projection; empty lists where every layer is bf16
    qkv_scale: list[torch.Tensor]
    o_scale: list[torch.Tensor]
    gate_up_scale: list[torch.Tensor]
    down_scale: list[torch.Tensor]
    # Qwen3's per-head q/k norm weights; empty lists where the model has none
    q_norm: list[torch.Tensor]
    k_norm: list[torch.Tensor]
    # per layer: a sparse block's router weight [E, H] and its routed-pair counters
    # (`SparseMoeBlock.expert_tokens`), None for a dense MLP
    router: list[torch.Tensor | None]
    expert_tokens: list[torch.Tensor | None]
    top_k: int  # the sparse blocks' (0: none)
    normalize_top_k: bool
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
    # the sparse blocks' experts, whose `fused_steps` count the steps the stack serves them
    experts: list[FusedExperts]
    # tensor parallelism: the group that sums o_proj's and down_proj's outputs inside the
    # stack; None in one process
    all_reduce: ShmCommunicator | None = None

    def serves(self, meta: CpuAttentionMetadata) -> bool:
        """Whether this step can run as one call: every chunk's attention within the C++
        kernels, no more tokens than the linears' kernels take, every sparse block's experts
        on the fused kernel for this step (`FusedExperts.takes_fused`'s size limit, which a
        caller may change), and no hooks to honour (speculator heads, scoring and GPTQ
        attach them)."""
        if meta.long is not None and not self.long_ok:
            return False
        if meta.num_tokens > self.max_tokens:
            return False
        if not all(e.stacked is not None and meta.num_tokens <= e.fused_max_tokens
                   for e in self.experts):
            return False  # a sparse block's experts would take the per-expert path
        return not (_global_hooks() or any(self.hook_dicts))

    def layer_args(self) -> tuple:
        """`kiln::llama_stack`'s arguments from input_norm to sin32, in its order."""
        return (self.input_norm, self.qkv, self.o, self.post_norm, self.gate_up, self.down,
                self.qkv_scale, self.o_scale, self.gate_up_scale, self.down_scale,
                self.q_norm, self.k_norm, self.router, self.expert_tokens, self.top_k,
                self.normalize_top_k, self.final_norm, self.cos32, self.sin32)


def _global_hooks() -> bool:
    return bool(torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks)


def stack_weights(model: LlamaForCausalLM, backend: CpuPagedAttention) -> StackWeights | None:
    """The model's `StackWeights`, or None when a layer is off the fused path: a feed-forward
    that is neither a dense MLP nor a sparse block the stack routes (`stack_moe`), or a
    linear whose method has no stack tensors (a bias, torch's matmul, a format other than
    oneDNN bf16, kiln's VNNI bf16, kiln's bf16-fp32 and weight-only int8)."""
    layers = list(model.model.layers)
    moe = [layer.sparse_moe() for layer in layers]
    blocks = [b for b in moe if b is not None]
    if any(not stack_moe(b) for b in blocks) or len({b.gate.spec for b in blocks}) > 1:
        return None
    mlp = [layer.dense_mlp() for layer in layers]
    if any(f is None and b is None for f, b in zip(mlp, moe, strict=True)):
        return None  # a feed-forward the stack does not know
    dense = [f for f in mlp if f is not None]
    attn = [layer.self_attn for layer in layers]
    projections = {"qkv": [a.qkv_proj for a in attn], "o": [a.o_proj for a in attn],
                   "gate_up": [f.gate_up_proj for f in dense],
                   "down": [f.down_proj for f in dense]}
    linears = [m for ms in projections.values() for m in ms]
    stored = {m: m.method.stack_tensors(m) for m in linears}
    if None in stored.values():
        return None
    reduce = _row_parallel_group(model, stored, projections)
    if reduce is False:
        return None
    a, norm, embed = model.arch, model.model.norm, model.model.embed_tokens
    bf16 = embed.weight.dtype == torch.bfloat16  # the stack's activations
    qk = [(x.q_norm.weight, x.k_norm.weight) for x in attn] if a.qk_norm else []
    spec = blocks[0].gate.spec if blocks else None
    bypassed = ([model] + layers + attn + dense + linears + blocks
                + [m for b in blocks for m in (b.gate, b.experts)]
                + ([n for x in attn for n in (x.q_norm, x.k_norm)] if a.qk_norm else []))
    return StackWeights(
        embed=embed, **_layer_tensors(projections, stored, moe),
        q_norm=[q for q, _ in qk], k_norm=[k for _, k in qk],
        router=[None if b is None else _router_tensor(b) for b in moe],
        expert_tokens=[None if b is None else b.expert_tokens for b in moe],
        top_k=0 if spec is None else spec.top_k,
        normalize_top_k=spec is not None and spec.normalize_top_k,
        experts=[b.experts for b in blocks],
        input_norm=[layer.input_layernorm.weight for layer in layers],
        post_norm=[layer.post_attention_layernorm.weight for layer in layers],
        final_norm=norm.weight, cos32=model.rotary.cos32, sin32=model.rotary.sin32,
        scale=a.head_dim ** -0.5, eps=norm.eps, num_heads=attn[0].num_heads,
        num_kv_heads=attn[0].num_kv_heads, head_dim=a.head_dim,
        plain_bf16=any(t.plain_bf16 for t in stored.values()),
        long_ok=backend.bf16_prefill and a.head_dim in (64, 128) and bf16,
        max_tokens=min((t.bf16_max_tokens if bf16 and t.bf16_max_tokens is not None
                        else t.max_tokens for t in stored.values()), default=math.inf),
        hook_dicts=[d for m in bypassed for d in (m._forward_hooks, m._forward_pre_hooks)],
        all_reduce=reduce)


def _row_parallel_group(model: LlamaForCausalLM, stored: dict[Linear, StackTensors],
                        projections: dict[str, list[Linear]]) -> ShmCommunicator | None | bool:
    """The group summing o_proj's and down_proj's outputs inside the stack (None in one
    process), or False where the stack would not sum the outputs the layers sum (over gloo:
    none; a column-parallel layer that reduces)."""
    row = {stored[m].all_reduce for m in projections["o"] + projections["down"]}
    column = {stored[m].all_reduce for m in projections["qkv"] + projections["gate_up"]}
    if column != {None} or len(row) != 1 or (None in row) != (model.tp.size == 1):
        return False
    return next(iter(row))


def _layer_tensors(projections: dict[str, list[Linear]], stored: dict[Linear, StackTensors],
                   moe: list[SparseMoeBlock | None]) -> dict[str, list[torch.Tensor]]:
    """Each projection's weight per layer (a sparse layer's gate_up and down: its stacked
    experts'), and their per-row scales per layer where any layer is int8 (else empty
    lists; a bf16 layer among int8 ones: NO_SCALE)."""
    out = {name: [stored[m].weight for m in ms] for name, ms in projections.items()}
    scales = {name: [stored[m].scale for m in ms] for name, ms in projections.items()}
    for name in ("gate_up", "down"):  # per layer: the dense MLP's, or the stacked experts'
        dense_weights, dense_scales = iter(out[name]), iter(scales[name])
        out[name], scales[name] = map(list, zip(*[
            (next(dense_weights), next(dense_scales)) if b is None
            else _expert_tensors(b.experts.stacked, name) for b in moe], strict=True))
    int8 = any(t.numel() for ts in scales.values() for t in ts)
    out.update({f"{name}_scale": ts if int8 else [] for name, ts in scales.items()})
    return out


def _expert_tensors(stacked: StackedExperts, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    scale = getattr(stacked, f"{name}_scale")
    return getattr(stacked, name), NO_SCALE if scale is None else scale


def _router_tensor(block: SparseMoeBlock) -> torch.Tensor:
    """The router's VNNI-packed copy where it holds one (Router.pack), else its weight."""
    gate = block.gate
    return gate.weight if gate.vnni_weight is None else gate.vnni_weight


def stack_moe(block: SparseMoeBlock) -> bool:
    """Whether the stack runs `block` as the per-layer path does: one process (no expert
    parallelism), a softmax router in the model dtype, bf16 (Mixtral, Qwen), with no groups,
    bias or scaling, choosing by kiln's route_softmax (`Router.pack`), no shared expert, and every held expert on the fused kernel's bf16 or
    int8 VNNI layout (`FusedExperts.stacked`; the kernel takes bf16 activations only). Other
    blocks keep their model on the per-layer path."""
    spec, stacked = block.gate.spec, block.experts.stacked
    return (block.shard.tp.size == 1 and block.experts.expert_slot is None
            and spec.scoring is Scoring.SOFTMAX and not spec.grouped
            and not spec.selection_bias and spec.scaling_factor == 1.0
            and not spec.fp32_weight and block.gate.weight.dtype == torch.bfloat16
            and block.gate.kernel_route and block.shared_mlp() is None
            and block.shared_expert_gate is None and stacked is not None
            and stacked.format in (ExpertFormat.BF16_VNNI, ExpertFormat.INT8_VNNI))


def fused_stack(w: StackWeights, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: KVCaches, meta: CpuAttentionMetadata) -> torch.Tensor:
    """Final hidden states [T, H] of every decoder layer and the final norm in one call to
    `kiln::llama_stack` (KV written), as the model's forward computes them. Tensor
    parallelism: a collective (the embedding's all-reduce, then two per layer inside the
    call); a rank that does not arrive makes it raise RankFailure after the group's timeout."""
    for experts in w.experts:  # (the count benchmarks/moe.py reports)
        experts.fused_steps += 1
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
