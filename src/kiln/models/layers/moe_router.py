"""The top-k router of a sparse mixture-of-experts block (kiln.models.layers.moe).

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

A config asking for a routing variant kiln does not run fails at load (`UnsupportedVariant`,
kiln.models.layers.moe_config), never with wrong tokens.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kiln.kernels import cpu as cpu_kernels
from kiln.kernels.bf16_vnni import pack_vnni, vnni_available, vnni_mm


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
    groups = choice.view(choice.shape[0], spec.num_groups,  # [T, G, E/G] (T may be 0)
                         spec.num_experts // spec.num_groups)
    group_scores = groups.topk(2, dim=-1).values.sum(dim=-1)  # [T, G]
    best = group_scores.topk(spec.top_k_groups, dim=-1).indices
    chosen = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    return chosen.unsqueeze(-1).expand_as(groups).reshape(choice.shape)
