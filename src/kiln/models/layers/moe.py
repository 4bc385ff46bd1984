"""A sparse mixture-of-experts feed-forward block: router, experts, weighted combine.

Each token's hidden state picks its k best experts by a learned router (kiln.models.layers.
moe_router, with the formulas), runs through each (kiln.models.layers.experts), and the block
returns the experts' outputs weighted by the router's scores, plus any always-on shared
expert's output (Qwen2-MoE's gated by a sigmoid, DeepSeek-V3's and GLM-4.5's not). The
block's sizes come from config.json through kiln.models.layers.moe_config.

Experts stay one module each (`experts.{e}.gate_up_proj`, HF's per-expert checkpoint names),
so expert parallelism places a subset of them per rank (kiln.models.layers.expert_parallel:
over T ranks a block holds every expert's share of the columns, or whole experts, and ends
with one all-reduce). Every block counts the (token, expert) pairs it routes per expert
(`expert_tokens`, a device tensor read only when asked: `collect_expert_load`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kiln.distributed.expert_dispatch import StepCounts, plan_dispatch
from kiln.models.layers.expert_parallel import ExpertShard
from kiln.models.layers.experts import ExpertMLP, FusedExperts, MethodFor
from kiln.models.layers.moe_config import MoeShape
from kiln.models.layers.moe_router import Router, Routing
from kiln.models.layers.parallel import SINGLE


class SharedExpertGate(nn.Module):
    """Qwen2-MoE's per-token gate on the shared expert: sigmoid(x w_s^T), HF's
    `shared_expert_gate.weight` [1, H]."""

    def __init__(self, hidden_size: int, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(1, hidden_size, dtype=dtype, device="cpu"),
                                   requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(F.linear(x, self.weight))  # [T, 1]



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
            columns = shard.shared_columns()
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
        if self.shard.dispatch is not None:
            return self.forward_dispatched(x)
        x = self.shard.gather(x)  # data-parallel attention: every rank's tokens (else x)
        routing = self.gate(x)
        owners = self.count(routing.experts)
        y = self.experts(x, routing, owners)
        return self.shard.reduce(self.add_shared(x, y))  # routed + shared partial sums

    def add_shared(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y plus the shared expert's output for x (gated where the family gates it)."""
        shared_mlp = self.shared_mlp()
        if shared_mlp is None:
            return y
        shared = shared_mlp(x)
        if self.shared_expert_gate is not None:
            shared = self.shared_expert_gate(x) * shared
        return y + shared

    def forward_dispatched(self, x: torch.Tensor) -> torch.Tensor:
        """Data-parallel attention's all-to-all exchange (kiln.distributed.expert_dispatch):
        x [n, H] this rank's tokens only, each sent to the ranks computing its pairs, whose
        partial sums come back and are added here, with this rank's whole shared experts.
        No all-reduce of the hidden states."""
        dispatch, routing = self.shard.dispatch, self.gate(x)
        owners = self.experts.owners(routing.experts, self.shard.exchange.first_row())
        plan = plan_dispatch(owners, routing.experts, dispatch.size, self.experts.num_experts)
        counts = dispatch.exchange_counts(plan)
        self.count_step(counts)
        got = dispatch.dispatch(x, routing.experts, routing.weights, owners, plan, counts)
        partial = torch.zeros_like(got.rows)
        if got.rows.shape[0]:  # the pairs computed here: the EP path on the received rows
            mine = torch.where(got.owned, dispatch.rank, -1)
            partial = self.experts(got.rows, Routing(got.weights, got.experts), mine)
        y = dispatch.combine(partial, plan, counts, x.shape[0])
        return self.add_shared(x, y.to(x.dtype))

    def count_step(self, counts: StepCounts) -> None:
        """Add a dispatched step's pairs, every rank's (the exchanged counts), to the
        counters: the same on every rank, as under the all-gather exchange."""
        self.expert_tokens += counts.expert_tokens().to(self.expert_tokens.device)
        self.rank_tokens += counts.rank_tokens().to(self.rank_tokens.device)

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
