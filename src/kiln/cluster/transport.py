"""The gateway's sockets: bytes in and out, msgspec structs at the edges, no decisions.

One ROUTER carries commands out and outputs in (every worker's DEALER connects to it, its
identity `"{worker_id}.{incarnation}"`); one SUB takes KV events (every worker's PUB connects
to it; kv_events.py). Spawned workers dial ipc:// paths; with a cluster address
(`kiln serve --cluster-address tcp://0.0.0.0:5555`) both sockets are TCP (events on port + 1)
and `kiln worker --gateway tcp://HOST:5555` joins from anywhere.

The transport knows identities, not workers: it sends a message to the identity it is given
and hands every frame that decodes to a worker message to one callback, with the sender's
parsed identity. Who is registered, who gets a request and what a message means are decided
by the client's supervision and placement.
"""

from __future__ import annotations

import asyncio
import logging
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import msgspec
import zmq
import zmq.asyncio

from kiln.cluster.kv_events import EventSubscriber
from kiln.cluster.messages import (
    Codec,
    GatewayMessage,
    KVEventBatch,
    WorkerMessage,
    parse_identity,
)

log = logging.getLogger("kiln.cluster")


@dataclass(frozen=True)
class Endpoints:
    router: str  # the ROUTER the gateway binds
    events: str  # the SUB the gateway binds
    dial: str  # what spawned workers connect to

    @classmethod
    def for_cluster(cls, address: str | None) -> Endpoints:
        """ipc:// paths unique to this process without an address; else TCP on the address's
        port (router) and port + 1 (events), dialled at 127.0.0.1 for a wildcard host."""
        if address is None:
            base = f"ipc://{tempfile.gettempdir()}/kiln-gateway-{os.getpid()}-{time.time_ns()}"
            return cls(f"{base}.sock", f"{base}-events.sock", f"{base}.sock")
        host, _, port = address.removeprefix("tcp://").rpartition(":")
        local = "127.0.0.1" if host in ("0.0.0.0", "*") else host
        return cls(address, f"tcp://{host}:{int(port) + 1}", f"tcp://{local}:{port}")


@dataclass(frozen=True)
class Peer:
    """Who sent a frame: its socket identity and what that identity says."""

    identity: bytes
    worker_id: str
    incarnation: int


class GatewayTransport:
    """The gateway's ZMQ context, ROUTER and SUB socket, and the two tasks reading them.

    Lifecycle: `start()` once inside the event loop (binds, starts reading), `send()` any time
    after, `stop_reading()` then `close()` once at the end. The callbacks run on the read
    tasks, one message at a time. Everything is on the gateway's event loop; no thread may
    call in.
    """

    def __init__(self, endpoints: Endpoints, on_message: Callable[[Peer, WorkerMessage], None],
                 on_events: Callable[[KVEventBatch], None]):
        self.endpoints = endpoints
        self.codec = Codec()
        self._on_message, self._on_events = on_message, on_events
        self._ctx = zmq.asyncio.Context()
        self._sock: zmq.asyncio.Socket | None = None
        self._events: EventSubscriber | None = None
        self._tasks: list[asyncio.Task] = []

    def start(self) -> None:
        """Bind both sockets and start the read tasks (they run from the next await on)."""
        self._sock = self._bind_router()
        self._events = EventSubscriber(self._ctx, self.endpoints.events, self._on_events)
        self._tasks = [asyncio.create_task(self._read_loop(), name="kiln-cluster-reader"),
                       asyncio.create_task(self._events.run(), name="kiln-cluster-events")]

    def _bind_router(self) -> zmq.asyncio.Socket:
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # sending to a gone worker raises
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a reconnecting identity takes over
        for opt in (zmq.SNDHWM, zmq.RCVHWM, zmq.LINGER):
            sock.setsockopt(opt, 0)
        sock.bind(self.endpoints.router)
        return sock

    def send(self, identity: bytes, message: GatewayMessage) -> bool:
        """Queue `message` for the peer `identity` without blocking. False when it cannot go:
        before `start()`, or no peer of that identity is connected."""
        if self._sock is None:
            return False
        sent = self._sock.send_multipart([identity, self.codec.encode(message)],
                                         flags=zmq.NOBLOCK)
        return not (sent.done() and sent.exception() is not None)

    async def _read_loop(self) -> None:
        while True:
            received = self._decode(await self._sock.recv_multipart())
            if received is not None:
                self._on_message(*received)

    def _decode(self, frames: list[bytes]) -> tuple[Peer, WorkerMessage] | None:
        """The sender and its message; None (dropped) for a frame that is not ours."""
        parsed = parse_identity(frames[0]) if len(frames) == 2 else None
        if parsed is None:
            return None
        try:
            message = self.codec.decode_worker_message(frames[1])
        except msgspec.MsgspecError as exc:
            log.warning("dropped a frame that is not a worker message: %s", exc)
            return None
        return Peer(frames[0], *parsed), message

    async def stop_reading(self) -> None:
        """Cancel the read tasks and wait for them; sends still work until `close()`."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []

    def close(self) -> None:
        """Close the sockets and the context, and remove ipc:// socket files."""
        if self._sock is not None:
            self._sock.close(linger=0)
        if self._events is not None:
            self._events.close()
        self._ctx.term()
        for address in (self.endpoints.router, self.endpoints.events):
            if address.startswith("ipc://"):
                Path(address.removeprefix("ipc://")).unlink(missing_ok=True)
