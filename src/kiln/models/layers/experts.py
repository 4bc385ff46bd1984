"""The routed experts of a sparse mixture-of-experts block (kiln.models.layers.moe).

`FusedExperts` computes the sum without a Python loop over tokens: the T*k (token, expert)
pairs are sorted by expert once, the tokens gathered into that order, each *active* expert
runs one GEMM over its contiguous run of rows through its own `Linear` (so every weight format
of kiln.models.layers.linear serves experts too), and the rows are scattered back and summed
with their weights. A batch-1 decode step therefore reads only its k experts' weights: decode
cost follows the active parameters, not the total. Where the experts are bf16 VNNI-packed or
weight-only int8, decode-sized steps skip even that Python loop: the layer's experts are
stacked into one tensor per projection after loading and one C++ call (kiln.kernels.
moe_experts) groups, computes and combines them (docs/moe.md, "The fused expert kernel").

Experts stay one module each (`experts.{e}.gate_up_proj`, HF's per-expert checkpoint names),
so expert parallelism places a subset of them per rank (kiln.models.layers.expert_parallel).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping

import torch
from torch import nn

from kiln.kernels.moe_experts import (
    FUSED_MOE_ENABLED,
    ExpertFormat,
    StackedExperts,
    fused_max_tokens,
    fused_moe_available,
    moe_experts,
)
from kiln.models.layers.expert_parallel import ExpertShard, split_expert_methods
from kiln.models.layers.linear import Linear, LinearMethod
from kiln.models.layers.moe_router import Routing
from kiln.models.layers.parallel import SINGLE, TensorParallel

MethodFor = Callable[[str], LinearMethod | None]  # module prefix -> weight format


class ExpertMLP(nn.Module):
    """One expert, a SwiGLU MLP: down(silu(gate(x)) * up(x)), gate and up fused. With
    `columns` (a TensorParallel), this rank's share of its columns: the output is a partial
    sum the sparse block all-reduces."""

    def __init__(self, hidden_size: int, intermediate_size: int, prefix: str,
                 method_for: MethodFor, dtype: torch.dtype, ops,
                 columns: TensorParallel | None = None):
        super().__init__()
        width, gate_up, down = split_expert_methods(
            columns, intermediate_size, method_for(f"{prefix}.gate_up_proj"),
            method_for(f"{prefix}.down_proj"))
        self.gate_up_proj = Linear(hidden_size, [width] * 2, dtype=dtype, method=gate_up)
        self.down_proj = Linear(width, hidden_size, dtype=dtype, method=down)
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.silu_mul(self.gate_up_proj(x)))


class FusedExperts(nn.Module):
    """The experts this rank holds (`self[e]`, HF's `experts.{e}`; all E in one process)
    applied to routed tokens. Two paths with the same roundings: kiln's fused kernel (one C++
    call for all of a step's experts, on the held experts' bf16 VNNI-packed or int8 weights
    stacked by `stack_weights`) for steps of up to `fused_max_tokens` tokens, else one sort,
    one GEMM per active expert through its own Linear, one combine."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, prefix: str,
                 method_for: MethodFor, dtype: torch.dtype, ops,
                 shard: ExpertShard = ExpertShard(SINGLE), top_k: int = 1):
        super().__init__()
        self.prefix, self.num_experts, self.top_k = prefix, num_experts, top_k
        columns = shard.expert_columns()
        held = shard.held_experts(num_experts)
        for e in held:  # registered under HF's name, `{e}`
            self.add_module(str(e), ExpertMLP(hidden_size, intermediate_size, f"{prefix}.{e}",
                                              method_for, dtype, ops, columns))
        self.shard = shard
        # the fused kernel's weights (None: every step takes the per-expert path), the largest
        # step it serves, and how many steps each path served (benchmarks/moe.py reports them)
        self.stacked: StackedExperts | None = None
        self.fused_max_tokens = 0
        self.fused_steps = self.per_expert_steps = 0
        # expert id -> its slot in `stacked` where this rank holds a subset (expert
        # parallelism; experts held elsewhere map to slot 0, never read: they are not owned)
        slot = None
        if len(held) != num_experts:
            slot = torch.zeros(num_experts, dtype=torch.int64)
            slot[list(held)] = torch.arange(len(held))
        self.register_buffer("expert_slot", slot, persistent=False)
        # which rank computes each routed pair (expert parallelism only)
        copies, copy_rank = (None, None) if shard.placement is None else \
            shard.placement.copy_tables()
        self.register_buffer("copies", copies, persistent=False)
        self.register_buffer("copy_rank", copy_rank, persistent=False)

    def __getitem__(self, expert: int | str) -> ExpertMLP:
        return self._modules[str(expert)]

    def __iter__(self) -> Iterator[ExpertMLP]:
        """The experts held here, by expert id."""
        return iter(self._modules.values())

    def __len__(self) -> int:
        return len(self._modules)

    def elsewhere(self) -> tuple[str, ...]:
        """Checkpoint prefixes of the experts other ranks hold (the loader skips them)."""
        return tuple(f"{self.prefix}.{e}." for e in range(self.num_experts)
                     if str(e) not in self._modules)

    def owners(self, experts: torch.Tensor, first_token: int = 0) -> torch.Tensor:
        """[T, k] rank computing each routed pair under expert parallelism: copy t mod c_e of
        expert e's c_e copies computes token t's pair (a fixed rule: one rank's tokens). t
        counts from `first_token`: a data-parallel rank's first row's index in the step's
        batch of every rank's tokens (the all-to-all exchange routes only its own rows)."""
        token = torch.arange(first_token, first_token + experts.shape[0],
                             device=experts.device).unsqueeze(1)
        return self.copy_rank[experts, token % self.copies[experts]]

    def stack_weights(self) -> None:
        """Once, after loading (kiln.models.loader): stack the held experts' gate/up and
        down weights (bf16 VNNI-packed, or weight-only int8) into one tensor each for the
        fused kernel; each expert's Linear then reads a view into it (the weights are held
        once). Leaves the per-expert path alone where the kernel cannot serve the experts:
        another weight format, a bias, bf16 on a CPU without AVX512-BF16, KILN_FUSED_MOE=0."""
        layers = [lin for e in self for lin in (e.gate_up_proj, e.down_proj)]
        formats = {_expert_format(lin) for lin in layers}
        if not (FUSED_MOE_ENABLED and len(formats) == 1) or None in formats:
            return
        fmt = formats.pop()
        if not fused_moe_available(fmt):
            return
        self.stacked = StackedExperts(fmt, **{
            field: _stack_as_views([getattr(e, linear) for e in self], name)
            for field, linear, name in _STACKED_TENSORS[fmt]})
        self.fused_max_tokens = fused_max_tokens(self.num_experts, self.top_k)

    def _apply(self, fn, recurse=True):
        """`.to()` and its kin: a move off the CPU or a cast copies each expert's tensors on
        their own, so the stack no longer holds them; it is dropped (freeing its host copy)
        and the per-expert path serves."""
        super()._apply(fn, recurse)
        if self.stacked is not None and not self._stack_still_held():
            self.stacked, self.fused_max_tokens = None, 0
        return self

    def _stack_still_held(self) -> bool:
        first = next(iter(self))
        return all(getattr(getattr(first, linear), name, None) is not None
                   and getattr(getattr(first, linear), name).data_ptr()
                   == getattr(self.stacked, field)[0].data_ptr()
                   for field, linear, name in _STACKED_TENSORS[self.stacked.format])

    def takes_fused(self, x: torch.Tensor) -> bool:
        """Whether the fused kernel serves this step."""
        return (self.stacked is not None and x.shape[0] <= self.fused_max_tokens
                and x.dtype == torch.bfloat16 and x.device.type == "cpu" and x.dim() == 2)

    def forward(self, x: torch.Tensor, routing: Routing,
                owners: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, H] -> sum_j w_j * Expert_{ids_j}(x) [T, H] in x's dtype (fp32 combine); with
        `owners` (expert parallelism), over the pairs this rank owns only (a partial sum)."""
        owned = None if owners is None else owners == self.shard.tp.rank
        if self.takes_fused(x):
            self.fused_steps += 1
            slots = routing.experts if self.expert_slot is None else \
                self.expert_slot[routing.experts]
            return moe_experts(x, slots, routing.weights, self.stacked, owned)
        self.per_expert_steps += 1
        if owned is not None:
            return self.forward_owned(x, routing, owned)
        num_tokens, k = routing.experts.shape
        # (token, slot) pairs sorted by expert: each expert's rows form one contiguous run
        sorted_ids, order = routing.experts.flatten().sort(stable=True)
        permuted = x[order // k]  # [T*k, H]
        outs, start = [], 0
        for expert, count in active_runs(sorted_ids):  # one GEMM per active expert
            outs.append(self[expert](permuted[start:start + count]))
            start += count
        out = torch.cat(outs)
        unpermuted = torch.empty_like(out)
        unpermuted[order] = out  # back to (token, slot) order
        return combine(unpermuted.view(num_tokens, k, -1), routing.weights).to(x.dtype)

    def forward_owned(self, x: torch.Tensor, routing: Routing,
                      owned: torch.Tensor) -> torch.Tensor:
        """The weighted sum over the routed pairs marked in `owned` [T, k] (zeros elsewhere):
        the pairs gathered, sorted by expert, one GEMM per expert, added back per token."""
        tokens, slots = owned.nonzero(as_tuple=True)
        y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        if tokens.numel():
            sorted_ids, order = routing.experts[tokens, slots].sort(stable=True)
            rows, weights = tokens[order], routing.weights[tokens, slots][order]
            permuted, outs, start = x[rows], [], 0
            for expert, count in active_runs(sorted_ids):
                outs.append(self[expert](permuted[start:start + count]))
                start += count
            y.index_add_(0, rows, torch.cat(outs).float() * weights.unsqueeze(1))
        return y.to(x.dtype)


def _expert_format(layer: Linear) -> ExpertFormat | None:
    """The fused kernel's name for a finalized expert linear's format (None: it cannot read
    it): VNNI-packed bf16 (kiln.models.layers.vnni), weight-only int8 packed for int8_vnni_mm
    (kiln.quant on AVX512-VNNI CPUs) or weight-only int8 rows (kiln.quant elsewhere, which the
    fused decoder stack reads too: `stack_tensors`), without a bias, with its outputs in
    whole blocks of 16 rows. A tensor-parallel wrapper's inner format decides."""
    if layer.bias is not None or layer.out_features % 16:
        return None
    if getattr(layer, "vnni_weight", None) is not None:
        return ExpertFormat.BF16_VNNI
    if getattr(layer, "int8_vnni_weight", None) is not None:
        return ExpertFormat.INT8_VNNI
    inner = _inner_method(layer)
    stack_tensors = getattr(inner, "stack_tensors", None)
    tensors = None if stack_tensors is None else stack_tensors(layer)
    if tensors is not None and tensors.weight.dtype == torch.int8 and tensors.scale.numel():
        return ExpertFormat.INT8
    return None


def _inner_method(layer: Linear):
    """The layer's weight format under any tensor-parallel wrapper (ColumnParallel /
    PartialRowParallel: this rank's part)."""
    inner = layer.method
    while hasattr(inner, "inner"):
        inner = inner.inner
    return inner


def _stack_as_views(layers: list[Linear], name: str) -> torch.Tensor:
    """The layers' tensor `name` as one [len(layers), ...] tensor; each layer's own becomes a
    view into it (its old copy is freed)."""
    stacked = torch.stack([getattr(layer, name) for layer in layers])
    for i, layer in enumerate(layers):
        setattr(layer, name, stacked[i])
    return stacked


# each format's stacked tensors: (StackedExperts field, the expert's linear, its tensor there)
_STACKED_TENSORS: Mapping[ExpertFormat, tuple[tuple[str, str, str], ...]] = {
    ExpertFormat.BF16_VNNI: (("gate_up", "gate_up_proj", "vnni_weight"),
                             ("down", "down_proj", "vnni_weight")),
    ExpertFormat.INT8_VNNI: (("gate_up", "gate_up_proj", "int8_vnni_weight"),
                             ("down", "down_proj", "int8_vnni_weight"),
                             ("gate_up_scale", "gate_up_proj", "weight_scale"),
                             ("down_scale", "down_proj", "weight_scale")),
    ExpertFormat.INT8: (("gate_up", "gate_up_proj", "weight"), ("down", "down_proj", "weight"),
                        ("gate_up_scale", "gate_up_proj", "weight_scale"),
                        ("down_scale", "down_proj", "weight_scale")),
}


def active_runs(sorted_ids: torch.Tensor) -> Iterable[tuple[int, int]]:
    """(expert id, number of rows) of each expert that has any, from sorted expert ids."""
    experts, counts = torch.unique_consecutive(sorted_ids, return_counts=True)
    return zip(experts.tolist(), counts.tolist(), strict=True)


def combine(expert_out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum_j w[t, j] * expert_out[t, j] in fp32: [T, k, H], [T, k] -> [T, H]."""
    return torch.bmm(weights.unsqueeze(1), expert_out.float()).squeeze(1)
