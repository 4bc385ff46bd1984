"""A sparse mixture-of-experts feed-forward block: router, experts, weighted combine.

As in the papers (Shazeer et al. 2017; Mixtral; Qwen-MoE), each token's hidden state x picks
its k best experts by a learned router, runs through each (a SwiGLU MLP of its own), and the
block returns the experts' outputs weighted by the router's scores:

    scores  = softmax(x W_g^T)                      [T, E]   (fp32)
    w, ids  = top_k(scores)                         [T, k]   (renormalized if the family says)
    y       = sum_j w_j * Expert_{ids_j}(x)         [T, H]
    y      += sigmoid(x w_s^T) * SharedExpert(x)    (Qwen2-MoE's always-on shared expert)

DeepSeek-V3's router (GLM-4.5 uses the same) scores each expert with a sigmoid instead, chooses
with a learned bias added (the "auxiliary-loss-free" balancing: the bias steers which experts
run, never how much they weigh), first the best `topk_group` of `n_group` expert groups, then
the top k inside them, and scales the renormalized weights by `routed_scaling_factor`:

    s       = sigmoid(x W_g^T)                      [T, E]   (fp32 weight and logits, as HF)
    c       = s + b                                 (b: e_score_correction_bias, choice only)
    groups  = top_topk_group(sum of each group's 2 best c)
    ids     = top_k(c, masked to those groups);  w = s[ids] / sum s[ids] * routed_scaling_factor
    y       = sum_j w_j * Expert_{ids_j}(x) + SharedExperts(x)   (n_shared_experts, no gate)

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
so expert parallelism places a subset of them per rank (kiln.models.layers.expert_parallel:
over T ranks a block holds every expert's share of the columns, or whole experts, and ends
with one all-reduce). Every block counts the (token, expert) pairs it routes per expert
(`expert_tokens`, a device tensor read only when asked: `collect_expert_load`). `deepseek_moe_shape` reads
the DeepSeek-V3 / GLM-4.5 sparse block from their shared config fields; a config asking for a
variant kiln does not run fails at load (`check_moe_fields`), never with wrong tokens.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kiln.kernels import cpu as cpu_kernels
from kiln.kernels.bf16_vnni import pack_vnni, vnni_available, vnni_mm
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
from kiln.models.layers.parallel import SINGLE, TensorParallel

MethodFor = Callable[[str], LinearMethod | None]  # module prefix -> weight format


class UnsupportedVariant(ValueError):
    """config.json asks for a model variant kiln does not run; `field` names the entry."""

    def __init__(self, field: str, message: str):
        super().__init__(f"config.json field {field!r}: {message}")
        self.field = field


class Scoring(enum.Enum):
    """How router logits become expert scores."""

    SOFTMAX = "softmax"  # Mixtral, Qwen: the scores of a token sum to 1
    SIGMOID = "sigmoid"  # DeepSeek-V3, GLM-4.5: each expert scored on its own


@dataclass(frozen=True)
class RouterSpec:
    """A top-k router, read from an HF config."""

    num_experts: int  # E
    top_k: int  # k experts per token
    scoring: Scoring
    normalize_top_k: bool  # rescale the k chosen scores to sum to 1 (Mixtral always does)
    # DeepSeek-V3 / GLM-4.5 (the defaults leave the softmax routers as they are):
    num_groups: int = 1  # n_group: the experts split into this many equal groups
    top_k_groups: int = 1  # topk_group: a token chooses its experts inside this many groups
    selection_bias: bool = False  # e_score_correction_bias [E], added for the choice only
    scaling_factor: float = 1.0  # routed_scaling_factor, multiplies the combine weights
    fp32_weight: bool = False  # gate weight kept and applied in fp32 (HF keeps it so)

    def __post_init__(self):
        if self.num_experts < 1:
            raise UnsupportedVariant("num_experts", f"{self.num_experts} experts; need >= 1")
        if not 1 <= self.top_k <= self.num_experts:
            raise UnsupportedVariant("num_experts_per_tok", f"{self.top_k} experts per token "
                                     f"with {self.num_experts} experts; need 1..{self.num_experts}")
        self._check_groups()

    def _check_groups(self) -> None:
        e, g, kg = self.num_experts, self.num_groups, self.top_k_groups
        if g < 1 or e % g:
            raise UnsupportedVariant("n_group", f"{g} groups do not split {e} experts evenly")
        if not 1 <= kg <= g:
            raise UnsupportedVariant("topk_group", f"{kg} of {g} groups; need 1..{g}")
        if g > 1 and e // g < 2:  # a group's score is the sum of its two best experts
            raise UnsupportedVariant("n_group", f"{g} groups of {e} experts leave fewer than "
                                     f"2 per group")
        if self.top_k > kg * (e // g):
            raise UnsupportedVariant("num_experts_per_tok", f"{self.top_k} experts per token "
                                     f"but the {kg} chosen groups hold only {kg * (e // g)}")

    @property
    def grouped(self) -> bool:
        """Whether the group step can exclude any expert."""
        return self.top_k_groups < self.num_groups


@dataclass(frozen=True)
class Routing:
    """Each token's chosen experts and their combine weights."""

    weights: torch.Tensor  # [T, k] fp32
    experts: torch.Tensor  # [T, k] int64 expert ids


class Router(nn.Module):
    """scores = score(x W_g^T), then the top k (`route`). The logits are in the model dtype
    (Mixtral, Qwen) or in fp32 from an fp32 weight (DeepSeek-V3, GLM-4.5), as HF computes them.

    Holds HF's `gate.weight` [E, H] as a plain parameter, never a quantized format: routing
    decisions are discrete, and a rounded router would change which experts run. With a
    selection bias, also HF's `gate.e_score_correction_bias` [E] (fp32).

    A bf16 router on an AVX512-BF16 CPU also holds a VNNI-packed copy (`pack`, after loading)
    and computes its logits on kiln's VNNI kernel, rounded to bf16 as F.linear rounds them
    (the fused decoder stack reads the same copy, so both paths route alike): ATen's bf16
    linear took ~50 us a layer for one token's [1, H] x [H, E] (docs/moe.md)."""

    def __init__(self, hidden_size: int, spec: RouterSpec, dtype: torch.dtype):
        super().__init__()
        self.spec = spec
        weight_dtype = torch.float32 if spec.fp32_weight else dtype
        self.weight = nn.Parameter(torch.empty(spec.num_experts, hidden_size, dtype=weight_dtype,
                                               device="cpu"), requires_grad=False)
        self.e_score_correction_bias = None
        if spec.selection_bias:
            self.e_score_correction_bias = nn.Parameter(
                torch.zeros(spec.num_experts, dtype=torch.float32, device="cpu"),
                requires_grad=False)
        self.vnni_weight: torch.Tensor | None = None  # `pack`'s copy (not a buffer: CPU only)
        self.kernel_route = False  # the top k by kiln's route_softmax op (`pack`)

    def pack(self) -> None:
        """Once, after loading (kiln.models.loader), for a bf16 router on the CPU: the
        VNNI-packed copy where the CPU has AVX512-BF16, and a plain softmax's top k by kiln's
        `route_softmax` op (kernels/cpu/router.cpp: one loop per token, not ATen's softmax,
        topk, gather and renormalization) where kiln's kernels built."""
        if self.weight.dtype != torch.bfloat16 or self.weight.device.type != "cpu":
            return
        if vnni_available():
            self.vnni_weight = pack_vnni(self.weight.data)
        spec = self.spec
        self.kernel_route = (cpu_kernels.load() and spec.scoring is Scoring.SOFTMAX
                             and not spec.grouped and not spec.selection_bias
                             and spec.scaling_factor == 1.0)

    def forward(self, x: torch.Tensor) -> Routing:
        on_cpu = x.device.type == "cpu"
        if self.vnni_weight is not None and x.dtype == torch.bfloat16 and on_cpu:
            logits = vnni_mm(x, self.vnni_weight, self.spec.num_experts)
        else:
            logits = F.linear(x.to(self.weight.dtype), self.weight)  # [T, E]
        if self.kernel_route and on_cpu:
            return Routing(*torch.ops.kiln.route_softmax(logits, self.spec.top_k,
                                                         self.spec.normalize_top_k))
        return route(logits, self.spec, self.e_score_correction_bias)


# score function of each Scoring: fp32 logits [T, E] -> scores [T, E]
_SCORE_FUNCTIONS: Mapping[Scoring, Callable[[torch.Tensor], torch.Tensor]] = {
    Scoring.SOFTMAX: lambda logits: torch.softmax(logits, dim=-1),
    Scoring.SIGMOID: torch.sigmoid,
}
# added to the sum before renormalizing, as HF's DeepSeek-V3/GLM routers (k sigmoid scores may
# all be ~0); k softmax scores sum to at least k/E, where it changes no bit
_NORMALIZE_EPS = 1e-20


def route(logits: torch.Tensor, spec: RouterSpec,
          bias: torch.Tensor | None = None) -> Routing:
    """The top-k choice from router logits [T, E] (the exact-value unit tests call this).
    `experts` are chosen from the scores plus `bias` [E] (DeepSeek's score correction),
    restricted to each token's best groups; `weights` gather the plain scores."""
    scores = _SCORE_FUNCTIONS[spec.scoring](logits.float())
    choice = scores if bias is None else scores + bias
    if spec.grouped:
        choice = choice.masked_fill(~group_mask(choice, spec), float("-inf"))
    experts = choice.topk(spec.top_k, dim=-1).indices
    weights = scores.gather(1, experts)
    if spec.normalize_top_k:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + _NORMALIZE_EPS)
    if spec.scaling_factor != 1.0:
        weights = weights * spec.scaling_factor
    return Routing(weights, experts)


def group_mask(choice: torch.Tensor, spec: RouterSpec) -> torch.Tensor:
    """[T, E] bool: True for the experts of each token's `top_k_groups` best groups, a group
    scored by the sum of its two best choice scores (DeepSeek-V3's node-limited routing)."""
    groups = choice.view(choice.shape[0], spec.num_groups, -1)  # [T, G, E/G]
    group_scores = groups.topk(2, dim=-1).values.sum(dim=-1)  # [T, G]
    best = group_scores.topk(spec.top_k_groups, dim=-1).indices
    chosen = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    return chosen.unsqueeze(-1).expand_as(groups).reshape(choice.shape)


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

    def owners(self, experts: torch.Tensor) -> torch.Tensor:
        """[T, k] rank computing each routed pair under expert parallelism: copy t mod c_e of
        expert e's c_e copies computes token t's pair (a fixed rule: one rank's tokens)."""
        token = torch.arange(experts.shape[0], device=experts.device).unsqueeze(1)
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


class SharedExpertGate(nn.Module):
    """Qwen2-MoE's per-token gate on the shared expert: sigmoid(x w_s^T), HF's
    `shared_expert_gate.weight` [1, H]."""

    def __init__(self, hidden_size: int, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(1, hidden_size, dtype=dtype, device="cpu"),
                                   requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(F.linear(x, self.weight))  # [T, 1]


@dataclass(frozen=True)
class MoeShape:
    """The sizes of one sparse block."""

    hidden_size: int
    expert_intermediate_size: int
    router: RouterSpec
    # the always-on expert's width (None: none; DeepSeek's n_shared_experts experts are one
    # MLP n_shared_experts times as wide), whether a sigmoid gate scales it (Qwen2-MoE), and
    # its checkpoint name (Qwen's `shared_expert`, DeepSeek's and GLM's `shared_experts`)
    shared_intermediate_size: int | None = None
    shared_expert_gate: bool = False
    shared_expert_name: str = "shared_expert"


class SparseMoeBlock(nn.Module):
    """Router + routed experts (+ an optional, optionally gated, shared expert), HF's module
    names: `gate`, `experts.{e}`, `shared_expert` (or `shared_experts`), `shared_expert_gate`.
    `shard`: this rank's part (kiln.models.layers.expert_parallel; one process: everything).
    `layer` is the decoder layer index the load counters report under."""

    def __init__(self, shape: MoeShape, prefix: str, method_for: MethodFor,
                 dtype: torch.dtype, ops, shard: ExpertShard = ExpertShard(SINGLE),
                 layer: int = 0):
        super().__init__()
        h, num_experts = shape.hidden_size, shape.router.num_experts
        self.gate = Router(h, shape.router, dtype)  # replicated: every rank routes the same
        self.experts = FusedExperts(h, shape.expert_intermediate_size, num_experts,
                                    f"{prefix}.experts", method_for, dtype, ops, shard,
                                    shape.router.top_k)
        self.shared_name = None
        if shape.shared_intermediate_size:
            self.shared_name = shape.shared_expert_name
            columns = None if shard.tp.comm is None else shard.tp  # always split by columns
            setattr(self, self.shared_name,
                    ExpertMLP(h, shape.shared_intermediate_size,
                              f"{prefix}.{self.shared_name}", method_for, dtype, ops, columns))
        self.shared_expert_gate = None
        if shape.shared_expert_gate:
            self.shared_expert_gate = SharedExpertGate(h, dtype)
        self.shard, self.layer = shard, layer
        # routed (token, expert) pairs per expert since start, and per rank under expert
        # parallelism (every rank counts the same routing; rank 0's are read)
        self.register_buffer("expert_tokens", torch.zeros(num_experts, dtype=torch.int64),
                             persistent=False)
        self.register_buffer("rank_tokens", torch.zeros(shard.tp.size, dtype=torch.int64)
                             if shard.expert_parallel else None, persistent=False)

    def shared_mlp(self) -> ExpertMLP | None:
        """The always-on expert, under its checkpoint name (None: the block has none)."""
        return None if self.shared_name is None else getattr(self, self.shared_name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.shard.gather(x)  # data-parallel attention: every rank's tokens (else x)
        routing = self.gate(x)
        owners = self.count(routing.experts)
        y = self.experts(x, routing, owners)
        shared_mlp = self.shared_mlp()
        if shared_mlp is not None:
            shared = shared_mlp(x)
            if self.shared_expert_gate is not None:
                shared = self.shared_expert_gate(x) * shared
            y = y + shared
        return self.shard.reduce(y)  # the routed and shared partial sums: one all-reduce

    def count(self, experts: torch.Tensor) -> torch.Tensor | None:
        """Add a step's routed pairs [T, k] to the counters (an index_add: no host sync, so a
        CUDA graph captures it); returns each pair's rank under expert parallelism."""
        flat = experts.flatten()
        self.expert_tokens.index_add_(0, flat, torch.ones_like(flat))
        if self.rank_tokens is None:
            return None
        owners = self.experts.owners(experts)
        self.rank_tokens.index_add_(0, owners.flatten(), torch.ones_like(flat))
        return owners


# config.json entries that mean a routing or attention variant (DeepSeek's router groups,
# bias and scaling, MLA, the sparse-attention indexer) and the values kiln's MoE families
# run; any other value fails at load.
_VARIANT_DEFAULTS: Mapping[str, tuple] = {
    "scoring_func": (None, "softmax"),
    "topk_method": (None, "greedy"),
    "n_group": (None, 1),
    "topk_group": (None, 1),
    "routed_scaling_factor": (None, 1, 1.0),
    "n_shared_experts": (None, 0),
    "n_routed_experts": (None,),
    "first_k_dense_replace": (None, 0),
    "moe_layer_freq": (None, 1),
    "kv_lora_rank": (None,),
    "q_lora_rank": (None,),
    "index_topk": (None,),
    "hidden_act": (None, "silu"),
}
# words that mark a config entry as part of the routing scheme: such an entry must be one a
# family's parser reads (or a training-only knob it lists), else kiln cannot tell whether the
# checkpoint routes the way kiln computes
_ROUTING_WORDS = ("router", "expert", "topk", "top_k", "moe", "scoring", "routed", "n_group",
                  "lora_rank", "index_")


def check_moe_fields(cfg: Mapping, known: Iterable[str], family: str,
                     variants: Mapping[str, tuple] = _VARIANT_DEFAULTS) -> None:
    """Raise UnsupportedVariant naming the first entry of `cfg` that asks for a variant kiln's
    `family` does not run: a `variants` field (name -> the values kiln runs, None: absent)
    with another value, or a routing entry the family does not know (`known`: the entries
    it reads or may ignore)."""
    known = frozenset(known)
    for field, accepted in variants.items():
        if cfg.get(field) not in accepted:
            runs = "" if accepted[-1] is None else f" (it runs {accepted[-1]!r})"
            raise UnsupportedVariant(field, f"{cfg[field]!r} is not supported by kiln's "
                                     f"{family}{runs}")
    for field in cfg:
        if field not in known and field not in variants and any(
                word in field for word in _ROUTING_WORDS):
            raise UnsupportedVariant(field, f"unknown routing option for {family}; kiln "
                                     f"reads only {', '.join(sorted(known))}")


# DeepSeek-V3's and GLM-4.5's routing entries that kiln reads (deepseek_moe_shape; the model
# files read first_k_dense_replace, MLA's attention reads the lora ranks) or may ignore
# (training only)
DEEPSEEK_ROUTING_FIELDS = (
    "n_routed_experts", "num_experts_per_tok", "n_group", "topk_group", "routed_scaling_factor",
    "norm_topk_prob", "n_shared_experts", "moe_intermediate_size", "topk_method",
    "scoring_func", "first_k_dense_replace", "moe_layer_freq", "kv_lora_rank", "q_lora_rank",
    "output_router_logits", "router_aux_loss_coef")
# the values of DeepSeek-V3's variant fields that kiln computes: sigmoid scores with the
# bias-corrected grouped top-k ("noaux_tc"), every layer past the first dense ones sparse, no
# sparse-attention indexer (DeepSeek-V3.2), SiLU experts
DEEPSEEK_VARIANTS: Mapping[str, tuple] = {
    "scoring_func": (None, "sigmoid"),
    "topk_method": (None, "noaux_tc"),
    "moe_layer_freq": (None, 1),
    "index_topk": (None,),
    "hidden_act": (None, "silu"),
}


# what transformers' DeepseekV3Config assumes for an absent (or null) optional field
DEEPSEEK_V3_DEFAULTS: Mapping[str, object] = {
    "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
    "n_shared_experts": 1,
}


def deepseek_moe_shape(cfg: dict, family: str = "DeepseekV3",
                       defaults: Mapping[str, object] = DEEPSEEK_V3_DEFAULTS) -> MoeShape:
    """The sparse block of DeepSeek-V3 and GLM-4.5 from their shared config.json fields:
    sigmoid router with the score-correction bias, n_group/topk_group grouped top-k,
    norm_topk_prob, routed_scaling_factor, and n_shared_experts always-on experts of
    moe_intermediate_size each (one MLP that wide). An absent optional field takes the
    family's HF default (`defaults`). Raises UnsupportedVariant naming the field of a
    variant kiln does not run."""
    check_moe_fields(cfg, DEEPSEEK_ROUTING_FIELDS, family, DEEPSEEK_VARIANTS)

    def get(field: str):
        return defaults[field] if cfg.get(field) is None else cfg[field]

    width = _required(cfg, "moe_intermediate_size")
    router = RouterSpec(
        num_experts=_required(cfg, "n_routed_experts"),
        top_k=_required(cfg, "num_experts_per_tok"), scoring=Scoring.SIGMOID,
        normalize_top_k=bool(get("norm_topk_prob")), num_groups=get("n_group"),
        top_k_groups=get("topk_group"), selection_bias=True,
        scaling_factor=float(get("routed_scaling_factor")), fp32_weight=True)
    shared = get("n_shared_experts")
    if shared < 0:
        raise UnsupportedVariant("n_shared_experts", f"{shared}; need >= 0")
    return MoeShape(_required(cfg, "hidden_size"), width, router,
                    shared_intermediate_size=shared * width or None,
                    shared_expert_name="shared_experts")


def _required(cfg: Mapping, field: str) -> int:
    if cfg.get(field) is None:
        raise UnsupportedVariant(field, "missing; the sparse layers need it")
    return cfg[field]
