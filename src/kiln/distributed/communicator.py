"""The collectives tensor parallelism calls, behind one small protocol.

A `Communicator` is what a sharded layer holds: `all_reduce_` after a row-parallel matmul
(and the vocab-parallel embedding), `gather_to_first` for the LM head's logits,
`all_to_all` for data-parallel ranks' dispatch of routed tokens (kiln.distributed.
expert_dispatch). The gloo
implementation here runs on any machine; a faster one (shared memory between ranks on one
machine, NCCL on GPUs) is another class with the same members: `ShmCommunicator` sums and
exchanges all-to-all through kiln.distributed.shm_allreduce and gathers over gloo.

Every collective is bounded: a rank that died makes the others' next collective fail at once
(gloo sees the closed connection), one that hangs makes it fail after `timeout_s`. Either way
the caller gets a `RankFailure` naming what happened, never a hang.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from datetime import timedelta
from typing import Protocol, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


class RankFailure(RuntimeError):
    """A collective or send between an engine's ranks failed: a rank died or stopped
    answering."""


class Communicator(Protocol):
    """The collectives of one group of ranks. Each call is made by every rank of the group,
    in the same order; a call returns once every rank has made it."""

    rank: int
    world_size: int

    def all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the ranks in place (fp32 or bf16); returns it."""

    def gather_to_first(self, tensor: torch.Tensor) -> list[torch.Tensor] | None:
        """Rank 0 gets every rank's `tensor` (same shape and dtype on all), in rank order;
        the other ranks get None."""

    def all_to_all(self, send: torch.Tensor, send_rows: list[int],
                   recv_rows: list[int]) -> torch.Tensor:
        """Rows of `send` [sum(send_rows), ...] go to the ranks in order (send_rows[j] rows
        to rank j); returns the rows received [sum(recv_rows), ...], rank 0's first.
        recv_rows[j] must be what rank j sends this rank; same dtype and row width on all."""


def open_gloo_group(store: dist.Store, name: str, rank: int, world_size: int,
                    timeout_s: float, host: str | None = None) -> dist.ProcessGroupGloo:
    """A gloo group of its own (not torch.distributed's global default group, so several
    engines can live in one process): `name` keeps its rendezvous keys apart in `store`.
    `host`: the address this rank listens on and tells its peers (across machines, the one
    they reach it at); None: gloo's default (this machine's hostname, else loopback)."""
    prefixed, timeout = dist.PrefixStore(name, store), timedelta(seconds=timeout_s)
    if host is None:
        return dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    options._timeout = timeout
    return dist.ProcessGroupGloo(prefixed, rank, world_size, options)


class GlooCommunicator:
    """`Communicator` over a gloo process group (TCP; loopback on one machine)."""

    def __init__(self, group: dist.ProcessGroupGloo, timeout_s: float):
        self.group = group
        self.rank, self.world_size = group.rank(), group.size()
        self.timeout_s = timeout_s

    def all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        """bf16 is summed in fp32 and rounded once, as the shared-memory all-reduce does, so
        both give the same bits whatever the number of ranks (benchmarks/tp_decode.py times
        gloo's own bf16 sum beside it)."""
        if tensor.dtype != torch.bfloat16:
            bounded(lambda: self.group.allreduce([tensor]).wait(), "all-reduce",
                    self.timeout_s)
            return tensor
        wide = tensor.float()
        bounded(lambda: self.group.allreduce([wide]).wait(), "all-reduce", self.timeout_s)
        return tensor.copy_(wide)

    def gather_to_first(self, tensor: torch.Tensor) -> list[torch.Tensor] | None:
        tensor = tensor.contiguous()
        options = dist.GatherOptions()
        options.rootRank = 0
        out = ([[torch.empty_like(tensor) for _ in range(self.world_size)]]
               if self.rank == 0 else [])
        bounded(lambda: self.group.gather(out, [tensor], options).wait(), "gather",
                self.timeout_s)
        return out[0] if self.rank == 0 else None

    def all_to_all(self, send: torch.Tensor, send_rows: list[int],
                   recv_rows: list[int]) -> torch.Tensor:
        """gloo's all_to_all_single with per-rank splits, on the rows' bytes (any dtype;
        rows off the CPU are staged through host memory)."""
        if send.device.type != "cpu":
            return self.all_to_all(send.cpu(), send_rows, recv_rows).to(send.device)
        recv = send.new_empty((sum(recv_rows), *send.shape[1:]))
        bounded(lambda: self.group.alltoall_base(
            _bytes(recv), _bytes(send.contiguous()), list(recv_rows), list(send_rows),
            dist.AllToAllOptions()).wait(), "all-to-all", self.timeout_s)
        return recv

    def close(self) -> None:
        """Release the group's connections (safe after a failure, unlike its destructor)."""
        self.group.shutdown()


class ShmCommunicator(GlooCommunicator):
    """All-reduce through a shared-memory segment (ranks on one machine); the gather, rarer
    and larger, stays on gloo. A rank that dies is seen here only when the wait for it times
    out (`timeout_s`), where gloo sees the closed connection at once."""

    def __init__(self, group: dist.ProcessGroupGloo, timeout_s: float, name: str,
                 max_bytes: int = 4 << 20):
        super().__init__(group, timeout_s)
        from kiln.distributed.shm_allreduce import ShmAllReduce

        self.shm = ShmAllReduce(name, self.rank, self.world_size, max_bytes,
                                timeout_s=timeout_s)

    def all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        bounded(lambda: self.shm.all_reduce_(tensor), "shared-memory all-reduce",
                self.timeout_s)
        return tensor

    def all_to_all(self, send: torch.Tensor, send_rows: list[int],
                   recv_rows: list[int]) -> torch.Tensor:
        """Through the shared segment too (ShmAllReduce.all_to_all): each rank writes its
        rows once, every rank copies out the rows meant for it."""
        if send.device.type != "cpu":
            return self.all_to_all(send.cpu(), send_rows, recv_rows).to(send.device)
        recv = send.new_empty((sum(recv_rows), *send.shape[1:]))
        row = math.prod(send.shape[1:]) * send.element_size()
        bounded(lambda: self.shm.all_to_all(
            send.contiguous(), [n * row for n in send_rows], recv,
            [n * row for n in recv_rows]), "shared-memory all-to-all", self.timeout_s)
        return recv

    def reduce_inside(self, kernel: Callable[[torch.Tensor, int, float], T], what: str) -> T:
        """`kernel(segment, rank, timeout_s)`: a C++ kernel that all-reduces through this
        group from inside itself (ShmAllReduce.inside; the fused decoder stack). Its failed
        all-reduce becomes a RankFailure, as `all_reduce_`'s does; any other error of the
        kernel's passes unchanged."""
        try:
            return self.shm.inside(kernel)
        except RuntimeError as exc:
            if not str(exc).startswith("shm all-reduce"):
                raise
            raise rank_failure(what, self.timeout_s, exc) from exc

    def close(self) -> None:
        self.shm.close()
        super().close()


def _bytes(rows: torch.Tensor) -> torch.Tensor:
    """[R, ...] -> its bytes [R, row bytes] uint8 (a view)."""
    row_bytes = rows[0].numel() * rows.element_size() if rows.shape[0] else \
        math.prod(rows.shape[1:]) * rows.element_size()
    return rows.view(torch.uint8).view(rows.shape[0], row_bytes)


def shm_available() -> bool:
    """Whether the shared-memory all-reduce can run here (its module and kiln's kernels)."""
    try:
        from kiln.distributed import shm_allreduce  # noqa: F401
    except ImportError:
        return False
    from kiln.kernels import cpu as cpu_kernels

    return cpu_kernels.load()


def bounded(collective: Callable[[], object], what: str, timeout_s: float,
            parallelism: str = "tensor-parallel") -> None:
    """Run a collective (or a point-to-point send or receive), turning gloo's failure (a peer
    closed its connection, or the group's timeout passed) into a RankFailure that says so."""
    try:
        collective()
    except RuntimeError as exc:
        raise rank_failure(what, timeout_s, exc, parallelism) from exc


def rank_failure(what: str, timeout_s: float, exc: RuntimeError,
                 parallelism: str = "tensor-parallel") -> RankFailure:
    return RankFailure(f"{parallelism} {what} failed: a rank died or did not answer "
                       f"within {timeout_s:g} s ({str(exc).splitlines()[0][:300]})")
