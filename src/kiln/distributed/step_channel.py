"""Rank 0 tells the other ranks what to run next: bytes broadcast as a uint8 tensor.

The payload is the sender's business (kiln.runner.rank_loop encodes msgspec structs; nothing
is pickled). Most steps' descriptions fit one fixed-size broadcast (the length in its first
8 bytes, then the payload); a longer one takes a second broadcast for the rest.

The channel has a gloo group of its own, whose timeout is effectively unbounded: a following
rank waits here while the engine is idle, for as long as that lasts. A dead rank 0 still ends
the wait at once (gloo sees the connection close), and a following rank also exits when its
parent process is gone (kiln.distributed.launch.exit_with_parent).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from kiln.distributed.communicator import bounded

HEADER_BYTES = 8192  # one broadcast carries a decode step of ~200 sequences
_LENGTH_BYTES = 8
IDLE_TIMEOUT_S = 10 * 365 * 86400.0  # the channel's group timeout: "forever"


class StepChannel:
    """Broadcast of byte strings from rank 0 over `group` (every rank calls in the same order:
    rank 0 `send`, the others `receive`)."""

    def __init__(self, group: dist.ProcessGroupGloo):
        self.group = group
        self.rank = group.rank()
        self.header = torch.zeros(HEADER_BYTES, dtype=torch.uint8)
        self.options = dist.BroadcastOptions()
        self.options.rootRank = 0

    def send(self, payload: bytes) -> None:
        assert self.rank == 0, "only rank 0 sends steps"
        size = len(payload)
        head = size.to_bytes(_LENGTH_BYTES, "little") + payload[:HEADER_BYTES - _LENGTH_BYTES]
        self.header[:len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
        self._broadcast(self.header)
        rest = payload[HEADER_BYTES - _LENGTH_BYTES:]
        if rest:
            self._broadcast(torch.frombuffer(bytearray(rest), dtype=torch.uint8))

    def receive(self) -> bytes:
        self._broadcast(self.header)
        head = self.header.numpy().tobytes()
        size = int.from_bytes(head[:_LENGTH_BYTES], "little")
        first = head[_LENGTH_BYTES:_LENGTH_BYTES + size]
        missing = size - len(first)
        if not missing:
            return first
        rest = torch.empty(missing, dtype=torch.uint8)
        self._broadcast(rest)
        return first + rest.numpy().tobytes()

    def _broadcast(self, tensor: torch.Tensor) -> None:
        bounded(lambda: self.group.broadcast([tensor], self.options).wait(), "step broadcast",
                IDLE_TIMEOUT_S)

    def close(self) -> None:
        self.group.shutdown()
