"""Data-parallel attention's token exchange around a mixture-of-experts block.

Under data-parallel attention (docs/moe.md, "Data-parallel attention") each of D ranks runs
attention, the dense layers and the LM head whole, on its own requests' tokens only; the
experts are split over the D ranks. So around every sparse block the ranks trade tokens:

    gather       x_r [n_r, H] on each rank  ->  X [N, H] on every rank  (rank r's rows at
                                                offset n_0 + .. + n_{r-1}; N = sum n_r)
    (the block)  every rank routes X and computes its experts' partial sum Y_r [N, H]
    reduce_own   sum_r Y_r, of which rank r keeps its own rows [n_r, H]

Both go through the group's all-reduce (`Communicator.all_reduce_`): the gather sums a zero
[N, H] buffer holding only this rank's rows, which is exact (x + 0 = x) in every dtype, and so
takes the shared-memory all-reduce on one machine (docs/shm_allreduce.md) with no collective
of its own; the reduce is the very all-reduce an expert-parallel block ends with, whose rows
each rank then cuts to its own. A rank with no tokens in a step joins both with n_r = 0.

The token counts n_r of the step are known to every rank before its forward (rank 0's step
command lists every rank's sequences), so `begin_step` records them once per step instead of
one more collective per sparse layer to exchange them.

That is the default `all2all_backend`, "allgather_reducescatter". With "alltoall" the
exchange holds an `ExpertDispatch` (kiln.distributed.expert_dispatch) and the sparse blocks
send each rank's routed tokens only to the ranks computing their pairs instead; the step's
token counts then only place each rank's rows in the step's batch (`first_row`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kiln.distributed.communicator import Communicator
from kiln.distributed.expert_dispatch import ExpertDispatch


class TokenExchange:
    """The data-parallel ranks' exchange of hidden states (all ranks call in the same order:
    `begin_step`, then `gather` and `reduce_own` once per sparse block)."""

    def __init__(self, comm: Communicator, all_to_all: bool = False):
        self.comm = comm
        self.rank, self.size = comm.rank, comm.world_size
        self.counts: tuple[int, ...] | None = None  # tokens per rank in the current step
        # all2all_backend "alltoall": the sparse blocks dispatch routed pairs instead of
        # gathering tokens (kiln.distributed.expert_dispatch)
        self.dispatch = ExpertDispatch(comm) if all_to_all else None
        # steps begun and bytes this rank put into the exchanges for the other ranks (each
        # all-reduce publishes its whole buffer; benchmarks/moe_ep.py reads them)
        self.steps, self.gathered_bytes = 0, 0

    def begin_step(self, counts: Sequence[int]) -> None:
        """The current step's tokens on each rank (the same list on every rank)."""
        if len(counts) != self.size:
            raise ValueError(f"token counts for {len(counts)} ranks; the group has {self.size}")
        self.counts = tuple(counts)
        self.steps += 1

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's rows [n_r, H] -> every rank's [N, H], in rank order."""
        start, total = self._own_rows(x.shape[0])
        full = x.new_zeros((total, x.shape[1]))
        full[start:start + x.shape[0]] = x
        self.gathered_bytes += full.nbytes
        return self.comm.all_reduce_(full) if total else full

    def reduce_own(self, partial: torch.Tensor) -> torch.Tensor:
        """The sum over the ranks of `partial` [N, H], this rank's rows of it [n_r, H]."""
        own = self.counts[self.rank]
        start, total = self._own_rows(own)
        if partial.shape[0] != total:
            raise RuntimeError(f"data-parallel reduce of {partial.shape[0]} rows; the step "
                               f"gathered {total}")
        self.gathered_bytes += partial.nbytes
        summed = self.comm.all_reduce_(partial) if total else partial
        return summed[start:start + own]

    @property
    def sent_bytes(self) -> int:
        """Bytes this rank has put into either exchange for the other ranks since start."""
        return self.gathered_bytes + (0 if self.dispatch is None else self.dispatch.sent_bytes)

    def first_row(self) -> int:
        """This rank's first token's index in the step's batch of every rank's tokens."""
        if self.counts is None:
            raise RuntimeError("data-parallel exchange used before begin_step")
        return sum(self.counts[:self.rank])

    def _own_rows(self, num_rows: int) -> tuple[int, int]:
        """(offset of this rank's rows, N) in the gathered batch; checks `num_rows`."""
        if self.counts is None:
            raise RuntimeError("data-parallel exchange used before begin_step")
        if num_rows != self.counts[self.rank]:
            raise RuntimeError(f"data-parallel rank {self.rank} has {num_rows} tokens; the "
                               f"step announced {self.counts[self.rank]}")
        return sum(self.counts[:self.rank]), sum(self.counts)
