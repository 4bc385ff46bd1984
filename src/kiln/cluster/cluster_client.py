"""`ClusterClient`: the gateway's EngineClient over any number of workers (one by default).

Sockets: one ROUTER (commands out, outputs in; every worker's DEALER connects to it) and one
SUB (KV events; every worker's PUB connects to it). Spawned workers dial ipc:// paths; with a
cluster address (`kiln serve --cluster-address tcp://0.0.0.0:5555`) both sockets are TCP
(events on port + 1) and `kiln worker --gateway tcp://HOST:5555` joins from anywhere.

Per request: the router (router.py) picks a worker from the KV index and the load tracker; a
long prompt with prefill workers present goes PREFILL -> HANDOFF -> DECODE (migration.py), the
rest runs LOCAL on one worker. Outputs flow back through the request's `OutputStream`.

Supervision: a tick checks every worker (process exit, heartbeat silence, WorkerFailed,
Goodbye). A lost worker is forgotten by the index and the load tracker; each of its requests
is retried, migrated or failed (migration.py); a spawned one is killed and restarted after a
backoff. Everything runs on the gateway's event loop; no locks.
"""

from __future__ import annotations

import asyncio
import logging
import os
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import msgspec
import zmq
import zmq.asyncio

from kiln.cluster.engine_client import (
    EngineOverloaded,
    EngineUnavailable,
    OutputStream,
    RequestRejected,
    WorkerLost,
)
from kiln.cluster.kv_events import EventSubscriber
from kiln.cluster.kv_index import KVIndex
from kiln.cluster.messages import (
    AbortRequests,
    AddDecode,
    AddPrefill,
    AddRequests,
    Codec,
    DecodeItem,
    Goodbye,
    Heartbeat,
    KVEventBatch,
    KVHandle,
    KVSnapshot,
    PrefillDone,
    Rejected,
    ReleaseKV,
    Reregister,
    ResyncKV,
    Shutdown,
    StepOutputs,
    Welcome,
    WorkerFailed,
    WorkerReady,
    WorkerStats,
    parse_identity,
    worker_identity,
)
from kiln.cluster.migration import (
    Leg,
    Recovery,
    Tracked,
    plan_recovery,
    prefill_request,
    without_finish,
)
from kiln.cluster.registry import Registry, WorkerHandle, WorkerSlot
from kiln.cluster.router import Candidate, Decision, LeastLoad, LoadTracker, Router, make_policy
from kiln.cluster.stats import ClusterCounters, sum_stats
from kiln.config import ClusterConfig
from kiln.engine.contract import EngineCoreOutput
from kiln.engine.core import EngineRequest
from kiln.engine.limits import EngineLimits

log = logging.getLogger("kiln.cluster")


@dataclass(frozen=True)
class Explanation:
    """What the gateway would do with a prompt now (GET-style: nothing is routed)."""

    mode: str  # aggregated | disaggregated (prefill leg shown) | local-prefill (short prompt)
    decision: Decision


@dataclass(frozen=True)
class Endpoints:
    router: str  # the ROUTER the gateway binds
    events: str  # the SUB the gateway binds
    dial: str  # what spawned workers connect to

    @classmethod
    def for_cluster(cls, address: str | None) -> Endpoints:
        if address is None:
            base = f"ipc://{tempfile.gettempdir()}/kiln-gateway-{os.getpid()}-{time.time_ns()}"
            return cls(f"{base}.sock", f"{base}-events.sock", f"{base}.sock")
        host, _, port = address.removeprefix("tcp://").rpartition(":")
        local = "127.0.0.1" if host in ("0.0.0.0", "*") else host
        return cls(address, f"tcp://{host}:{int(port) + 1}", f"tcp://{local}:{port}")


class ClusterClient:
    """EngineClient over the workers in `slots` (spawned) plus any that join over TCP."""

    def __init__(self, endpoints: Endpoints, slots: list[WorkerSlot], cluster: ClusterConfig,
                 *, block_size: int, heartbeat_timeout_s: float, start_timeout_s: float,
                 restart: bool, admission_queue_size: int, token: str = "",
                 tick_s: float = 0.1):
        self.endpoints, self.cluster = endpoints, cluster
        self.restart, self.admission_queue_size, self.tick_s = restart, admission_queue_size, tick_s
        self.registry = Registry(slots, heartbeat_timeout_s, start_timeout_s, token)
        self.index = KVIndex()
        self.router = Router(make_policy(cluster.router, cluster.prefill_weight,
                                         cluster.router_temperature), self.index,
                             LoadTracker(block_size))
        self.decode_policy = LeastLoad()
        self.counters = ClusterCounters()
        self.codec = Codec()
        self._ctx = zmq.asyncio.Context()
        self._sock: zmq.asyncio.Socket | None = None
        self._events: EventSubscriber | None = None
        self._tracked: dict[str, Tracked] = {}
        self._tasks: list[asyncio.Task] = []
        self._limits: EngineLimits | None = None
        self._first: WorkerReady | None = None
        self.num_restarts = 0
        self.fatal_error: str | None = None

    # -- EngineClient properties ------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return bool(self.registry.workers)

    @property
    def limits(self) -> EngineLimits | None:
        return self._limits

    @property
    def capacity(self) -> int:
        seqs = sum(h.info.max_num_seqs for h in self.registry.workers.values())
        return seqs + self.admission_queue_size if seqs else 0

    @property
    def stats(self) -> WorkerStats:
        return sum_stats([h.stats for h in self.registry.workers.values()])

    @property
    def num_open(self) -> int:
        return len(self._tracked)

    def worker_handles(self) -> list[WorkerHandle]:
        return list(self.registry.workers.values())

    # -- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        sock = self._sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # sending to a gone worker raises
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        for opt in (zmq.SNDHWM, zmq.RCVHWM, zmq.LINGER):
            sock.setsockopt(opt, 0)
        sock.bind(self.endpoints.router)
        self._events = EventSubscriber(self._ctx, self.endpoints.events, self._on_events)
        for slot in self.registry.slots.values():
            self._start_slot(slot)
        self._tasks = [asyncio.create_task(self._read_loop(), name="kiln-cluster-reader"),
                       asyncio.create_task(self._events.run(), name="kiln-cluster-events"),
                       asyncio.create_task(self._watch_loop(), name="kiln-cluster-watchdog")]

    async def close(self) -> None:
        self.fail_all("the server is shutting down")
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for handle in list(self.registry.workers.values()):
            if handle.slot is not None:  # joined workers stay up for the next gateway
                self._send(handle.worker_id, Shutdown())
        procs = [s.proc for s in self.registry.slots.values() if s.proc is not None]
        await asyncio.gather(*(asyncio.to_thread(p.join, 5.0) for p in procs))
        if self._sock is not None:
            self._sock.close(linger=0)
        if self._events is not None:
            self._events.close()
        self._ctx.term()
        for address in (self.endpoints.router, self.endpoints.events):
            if address.startswith("ipc://"):
                Path(address.removeprefix("ipc://")).unlink(missing_ok=True)

    def _start_slot(self, slot: WorkerSlot) -> None:
        slot.start()
        log.info("worker %s.%d started (pid %d, role %s)", slot.worker_id, slot.incarnation,
                 slot.proc.pid, slot.role)

    # -- requests -----------------------------------------------------------------------------

    def submit(self, requests: list[EngineRequest]) -> OutputStream:
        if not self.ready:
            raise EngineUnavailable("no engine worker is ready (starting or restarting)")
        if self.num_open + len(requests) > self.capacity:
            raise EngineOverloaded(f"the admission queue is full ({self.num_open} requests "
                                   f"open, capacity {self.capacity})")
        stream = OutputStream([r.request_id for r in requests], self.abort)
        batches: dict[tuple[str, type], list[EngineRequest]] = defaultdict(list)
        for r in requests:
            self._place(Tracked(r, stream, "", Leg.LOCAL, salt=r.cache_salt), batches)
        self._send_batches(batches)
        return stream

    def _place(self, t: Tracked, batches: dict[tuple[str, type], list[EngineRequest]]) -> None:
        """Route a request from its start; queue what to send in `batches`."""
        prompt = t.request.prompt_token_ids
        if self._disaggregate(len(prompt)):
            decision = self.router.route(t.request_id, prompt, t.salt, self._candidates("prefill"))
            t.leg, message, request = Leg.PREFILL, AddPrefill, prefill_request(t.request)
        else:
            decision = self.router.route(t.request_id, prompt, t.salt, self._candidates("decode"))
            t.leg, message, request = Leg.LOCAL, AddRequests, t.request
        t.worker = decision.chosen
        self._tracked[t.request_id] = t
        self.counters.record(decision)
        batches[(decision.chosen, message)].append(request)

    def _send_batches(self, batches: dict[tuple[str, type], list[EngineRequest]]) -> None:
        for (worker_id, message), requests in batches.items():
            self._send(worker_id, message(requests))

    def _disaggregate(self, num_prompt_tokens: int) -> bool:
        """Remote prefill: a long prompt, and both a prefill and a decode worker are up."""
        if num_prompt_tokens < self.cluster.disagg_min_tokens:
            return False
        roles = {h.role for h in self.registry.workers.values()}
        return "prefill" in roles and bool(roles & {"decode", "both"})

    def _candidates(self, work: str) -> list[Candidate]:
        """Ready workers for `work` (prefill | decode); every ready worker if none fits."""
        handles = list(self.registry.workers.values())
        fit = [h for h in handles if (h.can_prefill if work == "prefill" else h.can_decode)]
        return [Candidate(h.worker_id, self._overloaded(h)) for h in fit or handles]

    def _overloaded(self, h: WorkerHandle) -> bool:
        loads = self.router.loads
        return (h.stats.num_waiting >= self.cluster.overload_waiting
                or loads.num_open(h.worker_id) >= h.info.max_num_seqs + self.admission_queue_size)

    def explain(self, prompt_token_ids: list[int], salt: str | None) -> Explanation:
        """The decision `submit` would take for this prompt now; nothing is routed."""
        if not self.ready:
            raise EngineUnavailable("no engine worker is ready (starting or restarting)")
        if self._disaggregate(len(prompt_token_ids)):
            mode, work = "disaggregated", "prefill"
        else:
            roles = {h.role for h in self.registry.workers.values()}
            mode = "local-prefill" if "prefill" in roles else "aggregated"
            work = "decode"
        return Explanation(mode, self.router.explain(prompt_token_ids, salt,
                                                     self._candidates(work)))

    def abort(self, request_ids: list[str]) -> None:
        by_worker: dict[str, list[str]] = defaultdict(list)
        for rid in request_ids:
            t = self._untrack(rid)
            if t is not None and t.leg is not Leg.HANDOFF:
                by_worker[t.worker].append(rid)
        for worker_id, ids in by_worker.items():
            self._send(worker_id, AbortRequests(ids))

    def fail_all(self, reason: str) -> None:
        streams = {id(t.stream): t.stream for t in self._tracked.values()}
        self.abort(list(self._tracked))
        for stream in streams.values():
            stream.fail(WorkerLost(reason))

    def _untrack(self, request_id: str) -> Tracked | None:
        self.router.loads.release(request_id)
        return self._tracked.pop(request_id, None)

    def _send(self, worker_id: str, message) -> bool:
        handle = self.registry.workers.get(worker_id)
        if self._sock is None or handle is None:
            return False
        identity = worker_identity(worker_id, handle.info.incarnation)
        return self._send_to(identity, message, handle)

    def _send_to(self, identity: bytes, message, handle: WorkerHandle | None = None) -> bool:
        sent = self._sock.send_multipart([identity, self.codec.encode(message)],
                                         flags=zmq.NOBLOCK)
        if sent.done() and sent.exception() is not None:
            if handle is not None and handle.failure is None:
                handle.failure = f"the engine worker {handle.worker_id} is unreachable"
            return False
        return True

    # -- receiving ----------------------------------------------------------------------------

    async def _read_loop(self) -> None:
        while True:
            frames = await self._sock.recv_multipart()
            parsed = parse_identity(frames[0]) if len(frames) == 2 else None
            if parsed is None:
                continue
            try:
                message = self.codec.decode_worker_message(frames[1])
            except msgspec.MsgspecError as exc:
                log.warning("dropped a frame that is not a worker message: %s", exc)
                continue
            if isinstance(message, WorkerReady):
                self._on_ready(frames[0], message)
            elif self.registry.is_current(*parsed):
                handle = self.registry.workers[parsed[0]]
                handle.last_seen = time.monotonic()
                self._dispatch(handle, message)
            elif parsed[0] not in self.registry.slots:
                self._send_to(frames[0], Reregister())  # a joined worker we do not know

    def _dispatch(self, handle: WorkerHandle, message) -> None:
        if isinstance(message, StepOutputs):
            self._on_stats(handle, message.stats)
            for out in message.outputs:
                self._on_output(handle.worker_id, out)
        elif isinstance(message, Heartbeat):
            self._on_stats(handle, message.stats)
        elif isinstance(message, PrefillDone):
            self._on_prefill_done(handle.worker_id, message)
        elif isinstance(message, Rejected):
            self._reject(message)
        elif isinstance(message, KVSnapshot):
            if self.index.load_snapshot(handle.worker_id, message.seq, message.block_hashes):
                self._send(handle.worker_id, ResyncKV())
        elif isinstance(message, WorkerFailed):
            handle.failure = f"the engine worker {handle.worker_id} failed: {message.message}"
        elif isinstance(message, Goodbye):
            handle.failure = f"the engine worker {handle.worker_id} left: {message.reason}"

    def _on_ready(self, identity: bytes, info: WorkerReady) -> None:
        reason = self.registry.admit(info, self._first)
        if reason is not None:
            log.error("refused worker %s: %s", info.worker_id, reason)
            self._send_to(identity, Shutdown(reason))
            return
        if info.worker_id in self.registry.workers:
            self._remove(info.worker_id, f"the engine worker {info.worker_id} re-registered")
        handle = self.registry.register(info)
        self._first = self._first or info
        self._limits = self._limits or info.limits
        self.index.add_worker(info.worker_id)
        self._send(info.worker_id, Welcome(self.endpoints.events))
        self._send(info.worker_id, ResyncKV())
        log.info("worker %s.%d ready (%s, role %s): %s, %d KV blocks", info.worker_id,
                 info.incarnation, "spawned" if handle.slot else "joined", info.role,
                 info.model_path, info.limits.num_kv_blocks)

    def _on_stats(self, handle: WorkerHandle, stats: WorkerStats) -> None:
        handle.stats = stats
        if self.index.note_published(handle.worker_id, stats.kv_event_seq, time.monotonic()):
            self._send(handle.worker_id, ResyncKV())

    def _on_events(self, batch: KVEventBatch) -> None:
        if not self.registry.is_current(batch.worker_id, batch.incarnation):
            return
        if self.index.apply(batch.worker_id, batch.seq, batch.events):
            log.info("KV event gap from %s at batch %d: resyncing", batch.worker_id, batch.seq)
            self._send(batch.worker_id, ResyncKV())

    def _on_output(self, worker_id: str, out: EngineCoreOutput) -> None:
        t = self._tracked.get(out.request_id)
        if t is None or t.worker != worker_id or t.leg is Leg.HANDOFF:
            return
        out = t.absorb(out)
        if out.new_token_ids:
            self.router.loads.progressed(t.request_id, len(out.new_token_ids))
        if out.finished and t.leg is Leg.PREFILL and not t.prefill_completes(
                out, self._limits.max_model_len):
            t.leg = Leg.HANDOFF  # the first token goes out now; PrefillDone follows
            out = without_finish(out)
        elif out.finished:
            self._untrack(t.request_id)
        t.stream.deliver(out)

    def _on_prefill_done(self, worker_id: str, done: PrefillDone) -> None:
        t = self._tracked.get(done.request_id)
        if t is None or t.worker != worker_id or t.leg is not Leg.HANDOFF:
            if done.handle is not None:  # finished or aborted meanwhile: free the blocks
                self._send(worker_id, ReleaseKV([done.handle.handle_id]))
            return
        self._start_decode(t, done.handle)

    def _start_decode(self, t: Tracked, handle: KVHandle | None) -> None:
        decision = self.router.route(t.request_id, t.resume_tokens(), t.salt,
                                     self._candidates("decode"), self.decode_policy,
                                     charge_prefill=False)
        t.worker, t.leg = decision.chosen, Leg.DECODE
        self.counters.handoffs += 1
        self.counters.decisions[decision.chosen] += 1
        self._send(decision.chosen, AddDecode([DecodeItem(t.continuation(), handle)]))

    def _reject(self, message: Rejected) -> None:
        for r in message.rejections:
            t = self._tracked.get(r.request_id)
            if t is None:
                continue
            t.stream.abort()  # the rest of its group
            t.stream.fail(RequestRejected(r.message, r.param, r.code))

    # -- supervision --------------------------------------------------------------------------

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
        log.error("%s", reason)
        self._remove(worker_id, reason)
        slot = self.registry.slots.get(worker_id)
        if slot is None or slot.proc is None:
            return
        proc, slot.proc = slot.proc, None
        await asyncio.to_thread(proc.kill)
        if not slot.ever_ready:
            slot.dead = True
            self.fatal_error = f"the engine worker could not start: {reason}"
        elif not self.restart:
            slot.dead = True
        else:
            slot.restart_at = time.monotonic() + slot.backoff_s
            slot.backoff_s = min(slot.backoff_s * 2, 30.0)

    def _remove(self, worker_id: str, reason: str) -> None:
        """Forget a worker and recover each of its requests."""
        if self.registry.remove(worker_id) is None:
            return
        self.index.remove_worker(worker_id)
        self.router.loads.forget_worker(worker_id)
        for t in [t for t in self._tracked.values() if t.worker == worker_id]:
            self._recover(t, reason)

    def _recover(self, t: Tracked, reason: str) -> None:
        plan = plan_recovery(t, self.cluster.migration, self.cluster.max_migrations)
        if plan is Recovery.FAIL or not self.ready:
            self.counters.lost += 1
            self._fail_group(t, reason)
            return
        t.attempts += 1
        if plan is Recovery.RETRY:
            self.counters.retries += 1
            batches: dict[tuple[str, type], list[EngineRequest]] = defaultdict(list)
            self._place(t, batches)
            self._send_batches(batches)
            return
        self.counters.migrations += 1
        decision = self.router.route(t.request_id, t.resume_tokens(), t.salt,
                                     self._candidates("decode"))
        t.worker, t.leg = decision.chosen, Leg.LOCAL
        self.counters.decisions[decision.chosen] += 1
        self._send(decision.chosen, AddRequests([t.continuation()]))

    def _fail_group(self, t: Tracked, reason: str) -> None:
        """Fail the request's whole stream (its siblings are aborted where they run)."""
        self._untrack(t.request_id)
        self.abort([rid for rid in t.stream.open if rid in self._tracked])
        t.stream.fail(WorkerLost(reason))


