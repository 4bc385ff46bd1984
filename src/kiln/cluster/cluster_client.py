"""`ClusterClient`: the gateway's EngineClient over any number of workers (one by default).

A thin façade over three parts, each with its own module and contract:

  transport.py    the ZMQ sockets (ROUTER for commands and outputs, SUB for KV events):
                  sends msgspec structs to identities, hands decoded messages back; no decisions
  placement.py    which worker runs each leg (router + KV index + load tracker), the
                  PREFILL -> HANDOFF -> DECODE flow, the open requests and their streams; no I/O
  supervision.py  registration, heartbeats and health, spawning and restarting workers, and
                  retrying / migrating / failing the requests of a lost one

The client wires them together: admission (ready, capacity), the dispatch of each worker
message to the part that handles it, and the sends placement asks for. Everything runs on the
gateway's event loop; no locks.
"""

from __future__ import annotations

import time

from kiln.cluster.engine_client import EngineOverloaded, EngineUnavailable, OutputStream
from kiln.cluster.kv_index import KVIndex
from kiln.cluster.messages import (
    Goodbye,
    Heartbeat,
    KVEventBatch,
    KVSnapshot,
    PrefillDone,
    Rejected,
    StepOutputs,
    WorkerFailed,
    WorkerMessage,
    WorkerReady,
    WorkerStats,
)
from kiln.cluster.placement import Explanation, Placement, Send
from kiln.cluster.registry import Registry, WorkerHandle, WorkerSlot
from kiln.cluster.router import Router
from kiln.cluster.stats import ClusterCounters, sum_stats
from kiln.cluster.supervision import Supervisor
from kiln.cluster.transport import Endpoints, GatewayTransport, Peer
from kiln.config import ClusterConfig
from kiln.engine.core import EngineRequest
from kiln.engine.limits import EngineLimits


class ClusterClient:
    """EngineClient over the workers in `slots` (spawned) plus any that join over TCP.

    `transport`, `placement` and `supervisor` are its parts; `counters`, `index` and `router`
    (read by serve/metrics.py) are placement's.
    """

    def __init__(self, endpoints: Endpoints, slots: list[WorkerSlot], cluster: ClusterConfig,
                 *, block_size: int, heartbeat_timeout_s: float, start_timeout_s: float,
                 restart: bool, admission_queue_size: int, token: str = "",
                 tick_s: float = 0.1):
        self.admission_queue_size = admission_queue_size
        registry = Registry(slots, heartbeat_timeout_s, start_timeout_s, token)
        self.transport = GatewayTransport(endpoints, self._on_message, self._on_events)
        self.placement = Placement(cluster, registry.workers, block_size=block_size,
                                   admission_queue_size=admission_queue_size)
        self.supervisor = Supervisor(registry, self.transport, self.placement, cluster,
                                     restart=restart, tick_s=tick_s)

    # -- EngineClient properties ------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return self.supervisor.ready

    @property
    def limits(self) -> EngineLimits | None:
        return self.supervisor.limits

    @property
    def fatal_error(self) -> str | None:
        return self.supervisor.fatal_error

    @property
    def capacity(self) -> int:
        seqs = sum(h.info.max_num_seqs for h in self.worker_handles())
        return seqs + self.admission_queue_size if seqs else 0

    @property
    def stats(self) -> WorkerStats:
        return sum_stats([h.stats for h in self.worker_handles()])

    @property
    def num_open(self) -> int:
        return self.placement.num_open

    # -- what metrics read --------------------------------------------------------------------

    @property
    def num_restarts(self) -> int:
        return self.supervisor.num_restarts

    @property
    def counters(self) -> ClusterCounters:
        return self.placement.counters

    @property
    def index(self) -> KVIndex:
        return self.placement.index

    @property
    def router(self) -> Router:
        return self.placement.router

    def worker_handles(self) -> list[WorkerHandle]:
        return list(self.supervisor.registry.workers.values())

    # -- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        self.transport.start()
        self.supervisor.start()

    async def close(self) -> None:
        self.fail_all("the server is shutting down")
        await self.supervisor.stop()
        await self.transport.stop_reading()
        await self.supervisor.shut_down_workers()
        self.transport.close()

    # -- requests -----------------------------------------------------------------------------

    def submit(self, requests: list[EngineRequest]) -> OutputStream:
        self._check_ready()
        if self.num_open + len(requests) > self.capacity:
            raise EngineOverloaded(f"the admission queue is full ({self.num_open} requests "
                                   f"open, capacity {self.capacity})")
        stream = OutputStream([r.request_id for r in requests], self.abort)
        self._send(self.placement.place(requests, stream))
        return stream

    def explain(self, prompt_token_ids: list[int], salt: str | None) -> Explanation:
        """The decision `submit` would take for this prompt now; nothing is routed."""
        self._check_ready()
        return self.placement.explain(prompt_token_ids, salt)

    def abort(self, request_ids: list[str]) -> None:
        self._send(self.placement.abort(request_ids))

    def fail_all(self, reason: str) -> None:
        self._send(self.placement.fail_all(reason))

    def _check_ready(self) -> None:
        if not self.ready:
            raise EngineUnavailable("no engine worker is ready (starting or restarting)")

    def _send(self, sends: list[Send]) -> None:
        self.supervisor.send_all(sends)

    # -- what arrives -------------------------------------------------------------------------

    def _on_message(self, peer: Peer, message: WorkerMessage) -> None:
        if isinstance(message, WorkerReady):
            self.supervisor.on_ready(peer, message)
            return
        handle = self.supervisor.heard_from(peer)
        if handle is not None:
            self._dispatch(handle, message)

    def _dispatch(self, handle: WorkerHandle, message: WorkerMessage) -> None:
        worker_id = handle.worker_id
        if isinstance(message, StepOutputs):
            self._on_stats(handle, message.stats)
            for out in message.outputs:
                self.placement.on_output(worker_id, out, self.limits.max_model_len)
        elif isinstance(message, Heartbeat):
            self._on_stats(handle, message.stats)
        elif isinstance(message, PrefillDone):
            self._send(self.placement.on_prefill_done(worker_id, message))
        elif isinstance(message, Rejected):
            self.placement.on_rejected(message)
        elif isinstance(message, KVSnapshot):
            self._send(self.placement.on_kv_snapshot(worker_id, message))
        elif isinstance(message, WorkerFailed):
            self.supervisor.on_leaving(handle, f"the engine worker {worker_id} failed: "
                                               f"{message.message}")
        elif isinstance(message, Goodbye):
            self.supervisor.on_leaving(handle, f"the engine worker {worker_id} left: "
                                               f"{message.reason}")

    def _on_stats(self, handle: WorkerHandle, stats: WorkerStats) -> None:
        if stats.expert_load is None:  # step stats: keep the last heartbeat's expert load
            stats.expert_load = handle.stats.expert_load
        handle.stats = stats
        self._send(self.placement.on_kv_seq(handle.worker_id, stats.kv_event_seq,
                                            time.monotonic()))

    def _on_events(self, batch: KVEventBatch) -> None:
        if self.supervisor.registry.is_current(batch.worker_id, batch.incarnation):
            self._send(self.placement.on_kv_events(batch))
