"""Cluster membership: which workers exist, which are ready, which must go.

Two kinds of worker, one table of registered (ready) workers:

  spawned  `kiln serve` starts them (`WorkerSlot`: launcher, process, incarnation, restart
           backoff). A slot's worker is registered when its WorkerReady arrives; if its process
           exits, goes silent or fails, it is removed and (unless restarts are off) the slot
           starts the next incarnation after a backoff.
  joined   `kiln worker --gateway tcp://...` on any machine: registered by its WorkerReady,
           removed after silence, WorkerFailed or Goodbye. Nothing to restart from here.

Pure bookkeeping plus process handles; supervision.py does the socket I/O, kills and restarts
processes, and decides what happens to the requests of a removed worker.
"""

from __future__ import annotations

import hmac
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kiln.cluster.messages import WorkerReady, WorkerStats
from kiln.cluster.worker import WorkerProcess

Launcher = Callable[[int], WorkerProcess]  # incarnation -> a started worker process


@dataclass
class WorkerSlot:
    """A worker process this gateway spawns and supervises."""

    worker_id: str
    role: str
    launch: Launcher
    proc: WorkerProcess | None = None  # None between a loss and the restart
    incarnation: int = -1  # of the latest process started
    started_at: float = 0.0
    restart_at: float | None = None  # when to start the next incarnation
    backoff_s: float = 0.5
    restarts: int = 0
    dead: bool = False  # gave up (never started, or restarts are off)
    ever_ready: bool = False

    def start(self) -> None:
        """Start the next incarnation."""
        self.incarnation += 1
        self.proc = self.launch(self.incarnation)
        self.started_at, self.restart_at = time.monotonic(), None

    def lost(self, restart: bool, now: float) -> None:
        """Its process is gone (killed): restart after the backoff (0.5 s doubling to 30 s),
        or give up for good when `restart` is False."""
        if not restart:
            self.dead = True
            return
        self.restart_at = now + self.backoff_s
        self.backoff_s = min(self.backoff_s * 2, 30.0)


@dataclass
class WorkerHandle:
    """A registered worker: what it told us, its latest stats, when we last heard of it."""

    info: WorkerReady
    last_seen: float
    stats: WorkerStats = field(default_factory=WorkerStats)
    slot: WorkerSlot | None = None  # None for a worker that joined over the network
    failure: str | None = None  # WorkerFailed / Goodbye: the watchdog removes it

    @property
    def worker_id(self) -> str:
        return self.info.worker_id

    @property
    def role(self) -> str:
        return self.info.role

    @property
    def can_prefill(self) -> bool:
        return self.info.role in ("prefill", "both")

    @property
    def can_decode(self) -> bool:
        return self.info.role in ("decode", "both")


class Registry:
    """Spawned slots by id, registered workers by id, and the first worker ever admitted
    (whose model and KV geometry every later one must share)."""

    def __init__(self, slots: list[WorkerSlot], heartbeat_timeout_s: float,
                 start_timeout_s: float, token: str = ""):
        self.slots = {s.worker_id: s for s in slots}
        self.workers: dict[str, WorkerHandle] = {}
        self.first: WorkerReady | None = None
        self.heartbeat_timeout_s, self.start_timeout_s = heartbeat_timeout_s, start_timeout_s
        self.token = token

    def is_current(self, worker_id: str, incarnation: int) -> bool:
        """Messages count only from the registered incarnation of a worker."""
        handle = self.workers.get(worker_id)
        return handle is not None and handle.info.incarnation == incarnation

    def admit(self, info: WorkerReady) -> str | None:
        """Why `info` may not register (None: it may)."""
        first = self.first
        if self.token and not hmac.compare_digest(info.token.encode(), self.token.encode()):
            return "wrong or missing cluster token"
        slot = self.slots.get(info.worker_id)
        if slot is not None and slot.incarnation != info.incarnation:
            return f"{info.worker_id} is a spawned worker's id"
        if first is not None and (info.limits.vocab_size != first.limits.vocab_size
                                  or info.limits.block_size != first.limits.block_size
                                  or info.limits.max_model_len != first.limits.max_model_len):
            return (f"its model differs from the cluster's ({info.model_path}: "
                    f"{info.limits} vs {first.limits})")
        return None

    def register(self, info: WorkerReady) -> WorkerHandle:
        slot = self.slots.get(info.worker_id)
        handle = WorkerHandle(info, time.monotonic(), slot=slot)
        self.workers[info.worker_id] = handle
        self.first = self.first or info
        if slot is not None:
            slot.backoff_s, slot.ever_ready = 0.5, True
        return handle

    def remove(self, worker_id: str) -> WorkerHandle | None:
        return self.workers.pop(worker_id, None)

    def failures(self, now: float) -> list[tuple[str, str]]:
        """(worker id, reason) for every registered worker or slot that must be dropped."""
        found = []
        for handle in self.workers.values():
            reason = self._handle_failure(handle, now)
            if reason is not None:
                found.append((handle.worker_id, reason))
        for slot in self.slots.values():
            if slot.worker_id not in self.workers and slot.proc is not None:
                reason = self._slot_start_failure(slot, now)
                if reason is not None:
                    found.append((slot.worker_id, reason))
        return found

    def _handle_failure(self, handle: WorkerHandle, now: float) -> str | None:
        if handle.failure is not None:
            return handle.failure
        proc = handle.slot.proc if handle.slot is not None else None
        if proc is not None and not proc.alive:
            return (f"the engine worker {handle.worker_id} exited "
                    f"(status {proc.process.returncode})")
        if now - handle.last_seen > self.heartbeat_timeout_s:
            return (f"the engine worker {handle.worker_id} sent nothing for "
                    f"{self.heartbeat_timeout_s:g} s (stuck)")
        return None

    def _slot_start_failure(self, slot: WorkerSlot, now: float) -> str | None:
        if not slot.proc.alive:
            return (f"the engine worker {slot.worker_id} exited while starting "
                    f"(status {slot.proc.process.returncode})")
        if now - slot.started_at > self.start_timeout_s:
            return (f"the engine worker {slot.worker_id} did not start within "
                    f"{self.start_timeout_s:g} s")
        return None

    def due_restarts(self, now: float) -> list[WorkerSlot]:
        return [s for s in self.slots.values()
                if s.restart_at is not None and s.restart_at <= now and not s.dead]
