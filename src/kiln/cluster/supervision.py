"""Supervision: which workers are in the cluster, whether they are alive, and what happens to
the requests of one that is not.

Registration: a WorkerReady is admitted by the registry's rules (token, spawned identity, same
model and KV geometry as the first worker) or answered with Shutdown(reason); an admitted
worker gets Welcome (where to publish KV events) and ResyncKV. A message from a worker id the
gateway does not know (it restarted) is answered with Reregister.

Health: every message from a registered incarnation refreshes its `last_seen`; a tick checks
every worker (process exit, heartbeat silence, WorkerFailed, Goodbye, unreachable, a spawned
one that does not start in time). A lost worker is forgotten by the registry and by placement
(KV index, load tracker); each of its requests is retried, migrated or failed
(`migration.plan_recovery`, routed by placement); a spawned one is killed and restarted after
a backoff, or, if it never came up, the cluster is marked as unable to start (`fatal_error`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from typing import Protocol

from kiln.cluster.messages import (
    GatewayMessage,
    Reregister,
    ResyncKV,
    Shutdown,
    Welcome,
    WorkerReady,
    worker_identity,
)
from kiln.cluster.migration import Recovery, Tracked, plan_recovery
from kiln.cluster.placement import Placement, Send
from kiln.cluster.registry import Registry, WorkerHandle, WorkerSlot
from kiln.cluster.transport import Endpoints, Peer
from kiln.config import ClusterConfig
from kiln.engine.limits import EngineLimits

log = logging.getLogger("kiln.cluster")


class Outbox(Protocol):
    """What supervision needs of the transport (GatewayTransport; a fake in tests)."""

    endpoints: Endpoints

    def send(self, identity: bytes, message: GatewayMessage) -> bool:
        """Queue without blocking; False when no such peer is connected."""


class Supervisor:
    """Owns the registry (mutates it) and the spawned processes; sends through `transport` to
    registered workers by id; recovers a lost worker's requests through `placement` (which it
    mutates: forget_worker, retry, migrate, fail_lost).

    Lifecycle: `start()` spawns the slots and starts the watchdog task (inside the event
    loop, after the transport started); `stop()` ends the watchdog; `shut_down_workers()` asks
    the spawned workers to exit and waits for them. The other methods are called from the
    transport's read task or the client, on the same event loop; nothing is thread-safe.
    """

    def __init__(self, registry: Registry, transport: Outbox, placement: Placement,
                 cluster: ClusterConfig, *, restart: bool, tick_s: float = 0.1):
        self.registry, self.transport, self.placement = registry, transport, placement
        self.cluster, self.restart, self.tick_s = cluster, restart, tick_s
        self.num_restarts = 0
        self.fatal_error: str | None = None
        self._watch: asyncio.Task | None = None

    @property
    def ready(self) -> bool:
        return bool(self.registry.workers)

    @property
    def limits(self) -> EngineLimits | None:
        """The first admitted worker's limits (every later one shares them)."""
        return self.registry.first.limits if self.registry.first is not None else None

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        for slot in self.registry.slots.values():
            self._start_slot(slot)
        self._watch = asyncio.create_task(self._watch_loop(), name="kiln-cluster-watchdog")

    async def stop(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            await asyncio.gather(self._watch, return_exceptions=True)

    async def shut_down_workers(self) -> None:
        """Send Shutdown to every registered spawned worker (joined ones stay up for the next
        gateway) and wait up to 5 s for each spawned process, then kill it."""
        for handle in list(self.registry.workers.values()):
            if handle.slot is not None:
                self.send(handle.worker_id, Shutdown())
        procs = [s.proc for s in self.registry.slots.values() if s.proc is not None]
        await asyncio.gather(*(asyncio.to_thread(p.join, 5.0) for p in procs))

    def _start_slot(self, slot: WorkerSlot) -> None:
        slot.start()
        log.info("worker %s.%d started (pid %d, role %s)", slot.worker_id, slot.incarnation,
                 slot.proc.pid, slot.role)

    # -- sending ------------------------------------------------------------------------------

    def send(self, worker_id: str, message: GatewayMessage) -> bool:
        """Send to the registered incarnation of `worker_id`; False if it is not registered or
        unreachable (then it is marked failed: the watchdog removes it)."""
        handle = self.registry.workers.get(worker_id)
        if handle is None:
            return False
        identity = worker_identity(worker_id, handle.info.incarnation)
        if self.transport.send(identity, message):
            return True
        if handle.failure is None:  # a reason the worker gave itself stays
            handle.failure = f"the engine worker {worker_id} is unreachable"
        return False

    def send_all(self, sends: Iterable[Send]) -> None:
        for s in sends:
            self.send(s.worker_id, s.message)

    # -- registration and signs of life ---------------------------------------------------------

    def on_ready(self, peer: Peer, info: WorkerReady) -> None:
        """Admit and register a worker (replacing an older registration of its id), or send
        it away with the reason."""
        reason = self.registry.admit(info)
        if reason is not None:
            log.error("refused worker %s: %s", info.worker_id, reason)
            self.transport.send(peer.identity, Shutdown(reason))
            return
        if info.worker_id in self.registry.workers:
            self.remove(info.worker_id, f"the engine worker {info.worker_id} re-registered")
        handle = self.registry.register(info)
        self.placement.add_worker(info.worker_id)
        self.send(info.worker_id, Welcome(self.transport.endpoints.events))
        self.send(info.worker_id, ResyncKV())
        log.info("worker %s.%d ready (%s, role %s): %s, %d KV blocks", info.worker_id,
                 info.incarnation, "spawned" if handle.slot else "joined", info.role,
                 info.model_path, info.limits.num_kv_blocks)

    def heard_from(self, peer: Peer) -> WorkerHandle | None:
        """The registered worker `peer` speaks for, its `last_seen` refreshed. None for a
        stale incarnation (ignored) or an id the gateway does not know (asked to
        re-register, unless it is a spawned slot's id)."""
        if self.registry.is_current(peer.worker_id, peer.incarnation):
            handle = self.registry.workers[peer.worker_id]
            handle.last_seen = time.monotonic()
            return handle
        if peer.worker_id not in self.registry.slots:
            self.transport.send(peer.identity, Reregister())
        return None

    @staticmethod
    def on_leaving(handle: WorkerHandle, reason: str) -> None:
        """The worker said it failed or is leaving (WorkerFailed, Goodbye); the watchdog
        removes it on its next tick, with this reason."""
        handle.failure = reason

    # -- losing workers ---------------------------------------------------------------------

    async def _watch_loop(self) -> None:
        while True:
            await asyncio.sleep(self.tick_s)
            now = time.monotonic()
            for worker_id, reason in self.registry.failures(now):
                await self._lose(worker_id, reason)
            for slot in self.registry.due_restarts(now):
                self.num_restarts += 1
                self._start_slot(slot)

    async def _lose(self, worker_id: str, reason: str) -> None:
        """Remove the worker; kill a spawned one and restart it later, or give up."""
        log.error("%s", reason)
        self.remove(worker_id, reason)
        slot = self.registry.slots.get(worker_id)
        if slot is None or slot.proc is None:
            return
        proc, slot.proc = slot.proc, None
        await asyncio.to_thread(proc.kill)
        slot.lost(self.restart and slot.ever_ready, time.monotonic())
        if not slot.ever_ready:
            self.fatal_error = f"the engine worker could not start: {reason}"

    def remove(self, worker_id: str, reason: str) -> None:
        """Forget a registered worker and recover each of its requests."""
        if self.registry.remove(worker_id) is None:
            return
        self.placement.forget_worker(worker_id)
        for t in self.placement.requests_on(worker_id):
            if t.request_id in self.placement.tracked:  # not failed with a sibling just now
                self.send_all(self._recover(t, reason))

    def _recover(self, t: Tracked, reason: str) -> list[Send]:
        plan = plan_recovery(t, self.cluster.migration, self.cluster.max_migrations)
        if plan is Recovery.FAIL or not self.ready:
            return self.placement.fail_lost(t, reason)
        if plan is Recovery.RETRY:
            return self.placement.retry(t)
        return self.placement.migrate(t)
