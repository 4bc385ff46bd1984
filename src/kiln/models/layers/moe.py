"""A sparse mixture-of-experts feed-forward block: router, experts, weighted combine.

As in the papers (Shazeer et al. 2017; Mixtral; Qwen-MoE), each token's hidden state x picks
its k best experts by a learned router, runs through each (a SwiGLU MLP of its own), and the
block returns the experts' outputs weighted by the router's scores:

    scores  = softmax(x W_g^T)                      [T, E]   (fp32)
    w, ids  = top_k(scores)                         [T, k]   (renormalized if the family says)
    y       = sum_j w_j * Expert_{ids_j}(x)         [T, H]
    y      += sigmoid(x w_s^T) * SharedExpert(x)    (Qwen2-MoE's always-on shared expert)

`FusedExperts` computes the sum without a Python loop over tokens: the T*k (token, expert)
pairs are sorted by expert once, the tokens gathered into that order, each *active* expert
runs one GEMM over its contiguous run of rows through its own `Linear` (so every weight format
of kiln.models.layers.linear serves experts too), and the rows are scattered back and summed
with their weights. A batch-1 decode step therefore reads only its k experts' weights: decode
cost follows the active parameters, not the total.

Experts stay one module each (`experts.{e}.gate_up_proj`, HF's per-expert checkpoint names),
so expert parallelism can later place a subset of them per rank. The router is shaped for the
other routers (DeepSeek's sigmoid scores, grouped top-k, score-correction bias): `Scoring`
names the score function and `RouterSpec` is where their parameters join; a config asking for
one kiln does not run yet fails at load (`check_moe_fields`), never with wrong tokens.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kiln.models.layers.linear import Linear, LinearMethod

MethodFor = Callable[[str], LinearMethod | None]  # module prefix -> weight format


class UnsupportedVariant(ValueError):
    """config.json asks for a model variant kiln does not run; `field` names the entry."""

    def __init__(self, field: str, message: str):
        super().__init__(f"config.json field {field!r}: {message}")
        self.field = field


class Scoring(enum.Enum):
    """How router logits become expert scores (DeepSeek-V3's "sigmoid" is the next one)."""

    SOFTMAX = "softmax"


@dataclass(frozen=True)
class RouterSpec:
    """A top-k router, read from an HF config."""

    num_experts: int  # E
    top_k: int  # k experts per token
    scoring: Scoring
    normalize_top_k: bool  # rescale the k chosen scores to sum to 1 (Mixtral always does)

    def __post_init__(self):
        if self.num_experts < 1:
            raise UnsupportedVariant("num_experts", f"{self.num_experts} experts; need >= 1")
        if not 1 <= self.top_k <= self.num_experts:
            raise UnsupportedVariant("num_experts_per_tok", f"{self.top_k} experts per token "
                                     f"with {self.num_experts} experts; need 1..{self.num_experts}")


@dataclass(frozen=True)
class Routing:
    """Each token's chosen experts and their combine weights."""

    weights: torch.Tensor  # [T, k] fp32
    experts: torch.Tensor  # [T, k] int64 expert ids


class Router(nn.Module):
    """scores = softmax(x W_g^T) (logits in the model dtype, as HF), then the top k.

    Holds HF's `gate.weight` [E, H] as a plain parameter, never a quantized format: routing
    decisions are discrete, and a rounded router would change which experts run."""

    def __init__(self, hidden_size: int, spec: RouterSpec, dtype: torch.dtype):
        super().__init__()
        self.spec = spec
        self.weight = nn.Parameter(torch.empty(spec.num_experts, hidden_size, dtype=dtype,
                                               device="cpu"), requires_grad=False)

    def forward(self, x: torch.Tensor) -> Routing:
        logits = F.linear(x, self.weight)  # [T, E]
        return route(logits, self.spec)


# score function of each Scoring: fp32 logits [T, E] -> scores [T, E]
_SCORE_FUNCTIONS: Mapping[Scoring, Callable[[torch.Tensor], torch.Tensor]] = {
    Scoring.SOFTMAX: lambda logits: torch.softmax(logits, dim=-1),
}


def route(logits: torch.Tensor, spec: RouterSpec) -> Routing:
    """The top-k choice from router logits [T, E] (the exact-value unit tests call this).
    Grouped top-k and a selection bias would choose `experts` here from biased, group-masked
    scores while `weights` still gather the plain ones (DeepSeek-V3)."""
    scores = _SCORE_FUNCTIONS[spec.scoring](logits.float())
    weights, experts = scores.topk(spec.top_k, dim=-1)
    if spec.normalize_top_k:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return Routing(weights, experts)


class ExpertMLP(nn.Module):
    """One expert, a SwiGLU MLP: down(silu(gate(x)) * up(x)), gate and up fused."""

    def __init__(self, hidden_size: int, intermediate_size: int, prefix: str,
                 method_for: MethodFor, dtype: torch.dtype, ops):
        super().__init__()
        self.gate_up_proj = Linear(hidden_size, [intermediate_size] * 2, dtype=dtype,
                                   method=method_for(f"{prefix}.gate_up_proj"))
        self.down_proj = Linear(intermediate_size, hidden_size, dtype=dtype,
                                method=method_for(f"{prefix}.down_proj"))
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.silu_mul(self.gate_up_proj(x)))


class FusedExperts(nn.ModuleList):
    """E experts (`self[e]`, HF's `experts.{e}`) applied to routed tokens: one sort, one GEMM
    per active expert, one combine."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, prefix: str,
                 method_for: MethodFor, dtype: torch.dtype, ops):
        super().__init__(
            ExpertMLP(hidden_size, intermediate_size, f"{prefix}.{e}", method_for, dtype, ops)
            for e in range(num_experts))

    def forward(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        """x [T, H] -> sum_j w_j * Expert_{ids_j}(x) [T, H] in x's dtype (fp32 combine)."""
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
    # Qwen2-MoE's always-on expert (None: none) and whether a sigmoid gate scales it
    shared_intermediate_size: int | None = None
    shared_expert_gate: bool = False


class SparseMoeBlock(nn.Module):
    """Router + routed experts (+ an optional gated shared expert), HF's module names:
    `gate`, `experts.{e}`, `shared_expert`, `shared_expert_gate`."""

    def __init__(self, shape: MoeShape, prefix: str, method_for: MethodFor,
                 dtype: torch.dtype, ops):
        super().__init__()
        h = shape.hidden_size
        self.gate = Router(h, shape.router, dtype)
        self.experts = FusedExperts(h, shape.expert_intermediate_size, shape.router.num_experts,
                                    f"{prefix}.experts", method_for, dtype, ops)
        self.shared_expert = self.shared_expert_gate = None
        if shape.shared_intermediate_size:
            self.shared_expert = ExpertMLP(h, shape.shared_intermediate_size,
                                           f"{prefix}.shared_expert", method_for, dtype, ops)
        if shape.shared_expert_gate:
            self.shared_expert_gate = SharedExpertGate(h, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.experts(x, self.gate(x))
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = self.shared_expert_gate(x) * shared
            y = y + shared
        return y


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


def check_moe_fields(cfg: Mapping, known: Iterable[str], family: str) -> None:
    """Raise UnsupportedVariant naming the first entry of `cfg` that asks for a variant kiln's
    `family` does not run: a known variant field with another value, or a routing entry the
    family does not know (`known`: the entries it reads or may ignore)."""
    known = frozenset(known)
    for field, accepted in _VARIANT_DEFAULTS.items():
        if cfg.get(field) not in accepted:
            runs = "" if accepted[-1] is None else f" (it runs {accepted[-1]!r})"
            raise UnsupportedVariant(field, f"{cfg[field]!r} is not supported by kiln's "
                                     f"{family}{runs}")
    for field in cfg:
        if field not in known and field not in _VARIANT_DEFAULTS and any(
                word in field for word in _ROUTING_WORDS):
            raise UnsupportedVariant(field, f"unknown routing option for {family}; kiln "
                                     f"reads only {', '.join(sorted(known))}")
