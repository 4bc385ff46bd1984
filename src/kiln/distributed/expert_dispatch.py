"""All-to-all dispatch and combine of routed tokens between data-parallel expert ranks.

Under data-parallel attention with `all2all_backend="alltoall"` (docs/moe.md, "All-to-all
dispatch") each of D ranks routes only its own n tokens. A routed pair (token t, expert e) is
computed by one rank, expert e's copy `t mod c_e` (t: the token's index in the step's batch of
every rank's tokens, as under the all-gather exchange). A token goes once to each rank that
computes any of its k pairs, with its routing, and comes back as that rank's partial sum:

    plan       owners [n, k] -> the (rank, token) rows to send: token t to rank j when j
               computes any of t's pairs; rank-major, token order inside a rank
    counts     one all-reduce of a zero [D, 2D + E] fp32 table holding this rank's row (rows
               it sends each rank, its pairs per expert, its pairs per computing rank): every
               rank learns what it receives from whom, and the step's load counters
    dispatch   all-to-all of the rows [r, H], each with its k expert ids (-1: a pair another
               rank computes) and k router weights bit-cast into extra columns -> the m rows
               this rank computes for, in source-rank order
    (experts)  each received row's weighted sum over the pairs this rank computes [m, H]
               (kiln.models.layers.experts.FusedExperts, the fused kernel where it serves)
    combine    all-to-all back (the splits swapped) -> [r, H] in plan order; each token's
               partial sums added in rank order in fp32, rounded once (as the all-reduce sums
               the all-gather exchange's partial sums); the caller adds its shared experts

A rank sends each of its tokens at most min(k, D) times (to itself included) and gets back as
many rows, where the all-gather exchange puts the step's whole [N, H] batch through two
all-reduces (docs/decisions/0019). The counts cannot ride the step command as the all-gather's
token counts do: routing happens inside the forward, per rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.distributed.communicator import Communicator


@dataclass(frozen=True)
class DispatchPlan:
    """Where one rank's tokens go (pure bookkeeping, no communication)."""

    token: torch.Tensor  # [r] int64: the token of each sent row, rank-major
    dest: torch.Tensor  # [r] int64: the rank each row goes to (non-decreasing)
    send_counts: torch.Tensor  # [D] int64: rows sent to each rank
    expert_counts: torch.Tensor  # [E] int64: this rank's routed pairs per expert
    rank_pairs: torch.Tensor  # [D] int64: this rank's pairs each rank computes


def plan_dispatch(owners: torch.Tensor, experts: torch.Tensor, num_ranks: int,
                  num_experts: int) -> DispatchPlan:
    """owners, experts [n, k] int64 (each pair's computing rank and expert) -> the plan."""
    sent = torch.zeros(owners.shape[0], num_ranks, dtype=torch.bool, device=owners.device)
    sent.scatter_(1, owners, True)  # [n, D]: rank j computes some pair of token t
    dest, token = sent.t().nonzero(as_tuple=True)  # rank-major, tokens in order
    return DispatchPlan(token, dest, sent.sum(dim=0),
                        torch.bincount(experts.flatten(), minlength=num_experts),
                        torch.bincount(owners.flatten(), minlength=num_ranks))


def count_table(plan: DispatchPlan, rank: int) -> torch.Tensor:
    """This rank's row of the [D, 2D + E] fp32 counts table (zeros elsewhere); fp32 holds
    every count exactly below 2^24 a step."""
    d = plan.send_counts.numel()
    table = torch.zeros(d, 2 * d + plan.expert_counts.numel(), dtype=torch.float32)
    table[rank] = torch.cat([plan.send_counts, plan.rank_pairs, plan.expert_counts]).float()
    return table


@dataclass(frozen=True)
class StepCounts:
    """The summed counts table of one sparse block, the same on every rank. Row r: the rows
    rank r sends each rank [D], its pairs each rank computes [D], its pairs per expert [E]."""

    table: torch.Tensor  # [D, 2D + E] int64

    @property
    def num_ranks(self) -> int:
        return self.table.shape[0]

    def sends(self, rank: int) -> list[int]:
        return self.table[rank, :self.num_ranks].tolist()

    def receives(self, rank: int) -> list[int]:
        return self.table[:, rank].tolist()

    def rank_tokens(self) -> torch.Tensor:
        """[D] the step's routed pairs each rank computes."""
        return self.table[:, self.num_ranks:2 * self.num_ranks].sum(dim=0)

    def expert_tokens(self) -> torch.Tensor:
        """[E] the step's routed pairs per expert, over every rank's tokens."""
        return self.table[:, 2 * self.num_ranks:].sum(dim=0)


@dataclass(frozen=True)
class Received:
    """The rows one rank computes for in a block, with their routing."""

    rows: torch.Tensor  # [m, H] in source-rank order
    experts: torch.Tensor  # [m, k] int64 expert ids (0 where not computed here)
    weights: torch.Tensor  # [m, k] fp32 router weights
    owned: torch.Tensor  # [m, k] bool: the pairs this rank computes


def pack_rows(rows: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """rows [m, H], experts [m, k] int (-1: not computed by the receiver), weights [m, k]
    fp32 -> [m, H + 2k c]: the ids' int32 and the weights' fp32 bits in extra columns of the
    rows' dtype (c per 4 bytes; the all-to-all copies bytes, so they arrive unchanged)."""
    ids = experts.to(torch.int32).contiguous().view(rows.dtype)
    return torch.cat([rows, ids, weights.float().contiguous().view(rows.dtype)], dim=1)


def unpack_rows(packed: torch.Tensor, top_k: int) -> Received:
    """pack_rows' inverse."""
    c = 4 // packed.element_size()
    hidden = packed.shape[1] - 2 * top_k * c
    ids = packed[:, hidden:hidden + top_k * c].contiguous().view(torch.int32).long()
    weights = packed[:, hidden + top_k * c:].contiguous().view(torch.float32)
    return Received(packed[:, :hidden].contiguous(), ids.clamp(min=0), weights, ids >= 0)


class ExpertDispatch:
    """The data-parallel ranks' all-to-all exchange of routed tokens. Every rank calls
    `exchange_counts`, `dispatch` and `combine` once per sparse block, in that order, in the
    same block order (an idle rank with n = 0 too). `sent_bytes` counts what this rank put
    into the exchanges for other ranks (benchmarks/moe_ep.py reads it)."""

    def __init__(self, comm: Communicator):
        self.comm = comm
        self.rank, self.size = comm.rank, comm.world_size
        self.sent_bytes = 0

    def exchange_counts(self, plan: DispatchPlan) -> StepCounts:
        table = count_table(plan, self.rank)
        self.sent_bytes += table[self.rank].nbytes
        return StepCounts(self.comm.all_reduce_(table).round().long())

    def dispatch(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
                 owners: torch.Tensor, plan: DispatchPlan, counts: StepCounts) -> Received:
        """x [n, H] this rank's tokens, their routing [n, k] and each pair's rank -> the rows
        this rank computes for."""
        mine = owners[plan.token] == plan.dest.unsqueeze(1)  # [r, k] computed by the receiver
        ids = torch.where(mine, experts[plan.token], -1)
        packed = pack_rows(x[plan.token], ids, weights[plan.token])
        sends = counts.sends(self.rank)
        self.sent_bytes += (sum(sends) - sends[self.rank]) * packed[0:1].nbytes
        got = self.comm.all_to_all(packed, sends, counts.receives(self.rank))
        return unpack_rows(got, experts.shape[1])

    def combine(self, partial: torch.Tensor, plan: DispatchPlan, counts: StepCounts,
                num_tokens: int) -> torch.Tensor:
        """partial [m, H] the received rows' partial sums -> this rank's tokens' sums [n, H]
        (fp32: every computing rank's partial, added in rank order)."""
        receives = counts.receives(self.rank)
        self.sent_bytes += (sum(receives) - receives[self.rank]) * partial[0:1].nbytes
        back = self.comm.all_to_all(partial.contiguous(), receives, counts.sends(self.rank))
        y = torch.zeros(num_tokens, partial.shape[1], dtype=torch.float32,
                        device=partial.device)
        return y.index_add_(0, plan.token, back.float())
