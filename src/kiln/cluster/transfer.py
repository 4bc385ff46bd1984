"""KV transfer between workers: a prefill worker's held blocks, pulled by a decode worker.

Bytes and sockets only; the engine side (which blocks, importing them) is in worker_kv.py.

  prefill worker  `TransferServer`: a ROUTER socket. `hold()` registers blocks under a random
                  handle id with a deadline; a `PullBlocks` gets [BlocksHeader, payload]
                  (or PullFailed for an unknown/expired handle); `ReleaseBlocks`, the gateway's
                  ReleaseKV or the deadline (<= 30 s) frees them.
  decode worker   `TransferClient`: one DEALER per prefill worker; `pull()` sends PullBlocks
                  and records a deadline; `take_reply()` matches a reply to its pull;
                  `expired()` gives up on pulls past their deadline.

`check_payload` is the gate between the network and the KV cache: layout, block hashes,
shape, byte count and CRC32 must all match before a single byte is written; anything else
raises TransferError and the decode worker recomputes the prompt instead.

Fault injection (tests, chaos drills): KILN_FAULT_KV_TRANSFER=corrupt (flip a payload byte
after the checksum), short (drop the payload's last byte) or drop (never answer a pull).
"""

from __future__ import annotations

import logging
import os
import secrets
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import zmq

from kiln.cluster.messages import (
    BlocksHeader,
    Codec,
    KVHandle,
    KVLayout,
    PullBlocks,
    PullFailed,
    ReleaseBlocks,
)
from kiln.runner.kv_io import DTYPES, from_bytes

log = logging.getLogger("kiln.transfer")
FAULT_ENV = "KILN_FAULT_KV_TRANSFER"
MAX_HOLD_S = 30.0


class TransferError(Exception):
    """A pull that cannot be used: failed, timed out, or its bytes do not check out."""


def layout_nbytes(layout: KVLayout, num_blocks: int) -> int:
    elem = torch.empty((), dtype=DTYPES[layout.dtype]).element_size()
    n = 1
    for d in layout.shape(num_blocks):
        n *= d
    return n * elem


def check_payload(header: BlocksHeader, payload, layout: KVLayout,
                  expected_hashes: list[bytes]) -> torch.Tensor:
    """The payload as a KV tensor [L, 2, n * block_size, Hkv, D], or TransferError."""
    if header.layout != layout:
        raise TransferError(f"KV layout {header.layout} does not match ours {layout}")
    if header.block_hashes != expected_hashes:
        raise TransferError("the blocks sent are not the blocks asked for")
    shape = layout.shape(len(expected_hashes))
    nbytes = layout_nbytes(layout, len(expected_hashes))
    if list(header.shape) != shape or header.nbytes != nbytes:
        raise TransferError(f"header says {header.shape} / {header.nbytes} bytes, "
                            f"expected {shape} / {nbytes}")
    if len(payload) != nbytes:
        raise TransferError(f"payload has {len(payload)} bytes, expected {nbytes}")
    if zlib.crc32(payload) != header.crc32:
        raise TransferError("payload checksum mismatch (corrupted in transit)")
    return from_bytes(payload, DTYPES[layout.dtype], shape)


def make_header(handle_id: str, hashes: list[bytes], layout: KVLayout,
                payload: memoryview) -> BlocksHeader:
    return BlocksHeader(handle_id, hashes, layout, layout.shape(len(hashes)), len(payload),
                        zlib.crc32(payload))


# -- prefill side ----------------------------------------------------------------------------

@dataclass
class Held:
    handle: KVHandle
    blocks: list  # engine KVBlocks, pinned
    deadline: float


class TransferServer:
    """Blocks held for transfer and the socket decode workers pull them from.

    `export(blocks) -> (tensor bytes)` and `release(blocks)` are the engine side's callbacks;
    every path out of `held` (pulled and released, released by the gateway, expired) calls
    `release` exactly once."""

    def __init__(self, ctx: zmq.Context, bind_host: str, worker_id: str, layout: KVLayout,
                 export: Callable[[list], memoryview], release: Callable[[list], None],
                 hold_timeout_s: float = MAX_HOLD_S, advertise_host: str | None = None):
        self.socket = ctx.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.SNDHWM, 0)
        port = self.socket.bind_to_random_port(f"tcp://{bind_host}")
        self.address = f"tcp://{advertise_host or bind_host}:{port}"
        self.worker_id, self.layout = worker_id, layout
        self._export, self._release = export, release
        self.hold_timeout_s = min(hold_timeout_s, MAX_HOLD_S)
        self.held: dict[str, Held] = {}
        self.codec = Codec()
        self.fault = os.environ.get(FAULT_ENV, "")

    @property
    def num_blocks_held(self) -> int:
        return sum(len(h.blocks) for h in self.held.values())

    @property
    def num_blocks_held_only(self) -> int:
        """Held blocks no running request also uses (their only reference is the hold)."""
        return sum(b.ref_cnt == 1 for h in self.held.values() for b in h.blocks)

    def hold(self, blocks: list, hashes: list[bytes]) -> KVHandle:
        handle = KVHandle(secrets.token_hex(16), self.address, self.worker_id, hashes)
        self.held[handle.handle_id] = Held(handle, blocks,
                                           time.monotonic() + self.hold_timeout_s)
        return handle

    def release(self, handle_id: str) -> None:
        held = self.held.pop(handle_id, None)
        if held is not None:
            self._release(held.blocks)

    def expire(self, now: float) -> int:
        """Release holds past their deadline (nobody pulled them); how many."""
        late = [h for h, held in self.held.items() if held.deadline <= now]
        for handle_id in late:
            log.warning("KV hold %s expired unpulled; releasing its blocks", handle_id[:8])
            self.release(handle_id)
        return len(late)

    def next_deadline(self) -> float | None:
        return min((h.deadline for h in self.held.values()), default=None)

    def serve_one(self) -> bool:
        """Answer one waiting request (non-blocking); False if none was waiting."""
        try:
            identity, frame = self.socket.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return False
        except ValueError:
            return True  # wrong frame count: not ours
        try:
            message = self.codec.decode_transfer_request(frame)
        except Exception:
            log.warning("dropped a frame that is not a transfer request")
            return True
        if isinstance(message, ReleaseBlocks):
            self.release(message.handle_id)
        else:
            self._answer(identity, message)
        return True

    def _answer(self, identity: bytes, pull: PullBlocks) -> None:
        held = self.held.get(pull.handle_id)
        end = pull.start_block + pull.num_blocks
        if held is None or not 0 <= pull.start_block < end <= len(held.blocks):
            reply = PullFailed(pull.handle_id, "unknown or expired handle, or a bad range")
            self.socket.send_multipart([identity, self.codec.encode_any(reply)])
            return
        if self.fault == "drop":
            return
        payload = self._export(held.blocks[pull.start_block:end])
        header = make_header(pull.handle_id, held.handle.block_hashes[pull.start_block:end],
                             self.layout, payload)
        payload = self._inject_fault(payload)
        self.socket.send_multipart([identity, self.codec.encode_any(header), payload],
                                   copy=False)

    def _inject_fault(self, payload: memoryview):
        if self.fault == "corrupt":
            corrupted = bytearray(payload)
            corrupted[len(corrupted) // 2] ^= 0xFF
            return corrupted
        if self.fault == "short":
            return payload[:-1]
        return payload

    def close(self) -> None:
        for handle_id in list(self.held):
            self.release(handle_id)
        self.socket.close(linger=0)


# -- decode side -----------------------------------------------------------------------------

@dataclass
class Pull:
    """One pull in flight (`key` is the caller's: the request id)."""

    key: str
    handle: KVHandle
    start_block: int
    expected_hashes: list[bytes]
    started: float
    deadline: float
    context: object = None  # the caller's (the request to add afterwards)


@dataclass
class TransferClient:
    ctx: zmq.Context
    timeout_s: float = 10.0
    sockets: dict[str, zmq.Socket] = field(default_factory=dict)  # by prefill address
    pulls: dict[str, Pull] = field(default_factory=dict)  # by handle id
    codec: Codec = field(default_factory=Codec)

    def socket_for(self, address: str) -> tuple[zmq.Socket, bool]:
        """The DEALER to `address` and whether it was just made (to add to a poller)."""
        sock = self.sockets.get(address)
        if sock is not None:
            return sock, False
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.connect(address)
        self.sockets[address] = sock
        return sock, True

    def pull(self, key: str, handle: KVHandle, start_block: int,
             context: object = None) -> zmq.Socket | None:
        """Ask for blocks [start_block:] of `handle`; returns a socket new to the poller."""
        sock, new = self.socket_for(handle.address)
        now = time.monotonic()
        self.pulls[handle.handle_id] = Pull(key, handle, start_block,
                                            handle.block_hashes[start_block:], now,
                                            now + self.timeout_s, context)
        request = PullBlocks(handle.handle_id, start_block,
                             len(handle.block_hashes) - start_block)
        sock.send(self.codec.encode_any(request), zmq.NOBLOCK)
        return sock if new else None

    def release(self, handle: KVHandle) -> None:
        """Tell the prefill worker it may free the blocks (sent whatever the outcome)."""
        sock, _ = self.socket_for(handle.address)
        try:
            sock.send(self.codec.encode_any(ReleaseBlocks(handle.handle_id)), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # its hold timeout frees them

    def take_reply(self, sock: zmq.Socket) -> tuple[Pull, BlocksHeader | None, object, str]:
        """Read one reply: (its pull, header or None, payload, error message ("" if none)).
        Raises zmq.Again when nothing waits, KeyError for a reply to no pending pull."""
        frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
        try:
            reply = self.codec.decode_transfer_reply(frames[0].bytes)
        except Exception as exc:
            raise KeyError(f"not a transfer reply: {exc}") from exc
        pull = self.pulls.pop(reply.handle_id)
        if isinstance(reply, PullFailed):
            return pull, None, None, reply.message
        if len(frames) != 2:
            return pull, None, None, f"expected a payload frame, got {len(frames) - 1}"
        return pull, reply, frames[1].buffer, ""

    def cancel(self, key: str) -> Pull | None:
        for handle_id, pull in list(self.pulls.items()):
            if pull.key == key:
                return self.pulls.pop(handle_id)
        return None

    def expired(self, now: float) -> list[Pull]:
        late = [h for h, p in self.pulls.items() if p.deadline <= now]
        return [self.pulls.pop(h) for h in late]

    def next_deadline(self) -> float | None:
        return min((p.deadline for p in self.pulls.values()), default=None)

    def close(self) -> None:
        for sock in self.sockets.values():
            sock.close(linger=0)
        self.sockets.clear()
