"""KV events from workers to the gateway's index over ZMQ PUB/SUB.

The gateway binds one SUB socket; each worker connects a PUB socket to it (so workers on other
machines only ever dial out) once the gateway's Welcome names the address. A worker numbers
its batches 1, 2, 3... per incarnation. PUB/SUB may drop (a subscription still propagating, a
full queue): the index notices the gap and the gateway asks that worker for a snapshot.

Fault injection (tests): KILN_FAULT_DROP_KV_EVENTS="3,7" makes a worker number batches 3 and 7
as usual but never send them.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import msgspec
import zmq
import zmq.asyncio

from kiln.cluster.messages import Codec, KVEventBatch, KVSnapshot
from kiln.engine.prefix_cache import KVEvent, PrefixCache

log = logging.getLogger("kiln.kv_events")
DROP_ENV = "KILN_FAULT_DROP_KV_EVENTS"
TOPIC = b"kv"


class EventPublisher:
    """Worker side: numbers and publishes the prefix cache's events (one batch per call)."""

    def __init__(self, ctx: zmq.Context, worker_id: str, incarnation: int):
        self.ctx, self.worker_id, self.incarnation = ctx, worker_id, incarnation
        self.socket: zmq.Socket | None = None
        self.seq = 0
        self.codec = Codec()
        self._drop = {int(s) for s in os.environ.get(DROP_ENV, "").split(",") if s.strip()}

    def connect(self, address: str) -> None:
        if self.socket is not None:
            self.socket.close(linger=0)
        self.socket = self.ctx.socket(zmq.PUB)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(address)

    def publish(self, cache: PrefixCache) -> None:
        """Send whatever the cache emitted since the last call, as the next batch."""
        events: list[KVEvent] = cache.take_events()
        if not events:
            return
        self.seq += 1
        if self.socket is None or self.seq in self._drop:
            return  # lost (not connected yet, or injected): the gateway will resync
        batch = KVEventBatch(self.worker_id, self.incarnation, self.seq, events)
        self.socket.send_multipart([TOPIC, self.codec.encode_any(batch)], zmq.NOBLOCK)

    def snapshot(self, cache: PrefixCache) -> KVSnapshot:
        """Every hash held now, as of the latest batch (pending events are published first,
        so the snapshot and the numbering agree)."""
        self.publish(cache)
        return KVSnapshot(self.seq, cache.held_hashes())

    def close(self) -> None:
        if self.socket is not None:
            self.socket.close(linger=0)


class EventSubscriber:
    """Gateway side: one bound SUB socket; `run()` hands each decoded batch to `on_batch`."""

    def __init__(self, ctx: zmq.asyncio.Context, address: str,
                 on_batch: Callable[[KVEventBatch], None]):
        self.socket = ctx.socket(zmq.SUB)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.RCVHWM, 0)
        self.socket.setsockopt(zmq.SUBSCRIBE, TOPIC)
        self.socket.bind(address)
        self.address = self.socket.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.codec = Codec()
        self.on_batch = on_batch

    async def run(self) -> None:
        while True:
            frames = await self.socket.recv_multipart()
            if len(frames) != 2 or frames[0] != TOPIC:
                continue
            try:
                batch = self.codec.decode_events(frames[1])
            except msgspec.MsgspecError as exc:
                log.warning("dropped a frame that is not a KV event batch: %s", exc)
                continue
            self.on_batch(batch)

    def close(self) -> None:
        self.socket.close(linger=0)
