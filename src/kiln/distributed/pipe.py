"""Activations between neighbouring pipeline stages: gloo point-to-point sends and receives.

Stage s of P runs on rank (s + 1) % P: rank 0, the process that owns the scheduler and the
sampler, is the LAST stage, so the final hidden states, the logits and the sampled tokens
never leave it; the first stage is rank 1. Each micro-batch's activations travel as one
tensor (kiln.runner.pipeline: x and the residual stacked), tagged with the micro-batch's
index within the step.

Sends are asynchronous (the stage goes on to its next micro-batch while gloo sends) and
`flush` waits for them; a receive is posted early (`post_receive`) and waited on when its
micro-batch is due. Every wait is bounded: a peer that died fails it at once (gloo sees the
connection close), one that hangs fails it after `timeout_s`: a `RankFailure` either way.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from kiln.distributed.communicator import bounded


def rank_of_stage(stage: int, num_stages: int) -> int:
    return (stage + 1) % num_stages


def stage_of_rank(rank: int, num_stages: int) -> int:
    return (rank - 1) % num_stages


@dataclass
class PendingReceive:
    """A posted receive into `tensor`; `StagePipe.wait` returns the tensor once it landed."""

    work: dist.Work
    tensor: torch.Tensor


class StagePipe:
    """One rank's links to the previous and the next stage over a gloo group of every rank."""

    def __init__(self, group: dist.ProcessGroupGloo, timeout_s: float):
        self.group = group
        self.num_stages = group.size()
        self.stage = stage_of_rank(group.rank(), self.num_stages)
        self.timeout_s = timeout_s
        self.sending: list[tuple[dist.Work, torch.Tensor]] = []  # tensors live until sent

    def send_next(self, tensor: torch.Tensor, tag: int) -> None:
        """Start sending `tensor` (contiguous, left untouched until `flush`) to the next stage."""
        peer = rank_of_stage(self.stage + 1, self.num_stages)
        self.sending.append((self.group.send([tensor], peer, tag), tensor))

    def post_receive(self, tensor: torch.Tensor, tag: int) -> PendingReceive:
        """Post the receive of the previous stage's send `tag` into `tensor`."""
        peer = rank_of_stage(self.stage - 1, self.num_stages)
        return PendingReceive(self.group.recv([tensor], peer, tag), tensor)

    def wait(self, pending: PendingReceive) -> torch.Tensor:
        self._bounded(pending.work, "receive")
        return pending.tensor

    def flush(self) -> None:
        """Wait until every send started has gone."""
        sending, self.sending = self.sending, []
        for work, _ in sending:
            self._bounded(work, "send")

    def _bounded(self, work: dist.Work, what: str) -> None:
        timeout = timedelta(seconds=self.timeout_s)
        bounded(lambda: work.wait(timeout), f"stage {self.stage} {what}", self.timeout_s,
                "pipeline-parallel")

    def close(self) -> None:
        self.group.shutdown()
