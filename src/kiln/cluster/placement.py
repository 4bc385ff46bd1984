"""Placement: which worker runs each leg of a request, and following the request's legs.

Per request the router (router.py) picks a worker from the KV index and the load tracker. A
long prompt with prefill workers present goes PREFILL -> HANDOFF -> DECODE (migration.py): a
prefill worker computes the prompt and the first token, its PrefillDone names the held blocks,
and a decode worker chosen by decode load pulls them and goes on. Everything else runs LOCAL on
one worker. A request whose worker was lost is re-placed here too (`retry`, `migrate`), once
supervision has decided which.

`Placement` does no I/O: every method that wants a worker to hear something returns the
`Send`s, and the client hands them to the transport. It owns the table of open requests, the
router (with the KV index and the load tracker) and the counters; it reads the registry's table
of ready workers and never changes it. Outputs reach clients through each request's
`OutputStream` (`deliver` / `fail`, in memory); aborting a stream calls back into the client,
which calls `abort` here. Called on the gateway's event loop only.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

from kiln.cluster.engine_client import OutputStream, RequestRejected, WorkerLost
from kiln.cluster.kv_index import KVIndex
from kiln.cluster.messages import (
    AbortRequests,
    AddDecode,
    AddPrefill,
    AddRequests,
    DecodeItem,
    GatewayMessage,
    KVEventBatch,
    KVHandle,
    KVSnapshot,
    PrefillDone,
    Rejected,
    ReleaseKV,
    ResyncKV,
)
from kiln.cluster.migration import Leg, Tracked, prefill_request, without_finish
from kiln.cluster.registry import WorkerHandle
from kiln.cluster.router import Candidate, Decision, LeastLoad, LoadTracker, Router, make_policy
from kiln.cluster.stats import ClusterCounters
from kiln.config import ClusterConfig
from kiln.engine.contract import EngineCoreOutput
from kiln.engine.core import EngineRequest

log = logging.getLogger("kiln.cluster")

Work = Literal["prefill", "decode"]
Mode = Literal["aggregated", "disaggregated", "local-prefill"]


@dataclass(frozen=True)
class Send:
    """One message for one registered worker."""

    worker_id: str
    message: GatewayMessage


@dataclass(frozen=True)
class Explanation:
    """What the gateway would do with a prompt now (GET-style: nothing is routed)."""

    mode: Mode  # local-prefill: a short prompt in a cluster with prefill workers
    decision: Decision  # of the first leg (the prefill leg when disaggregated)


@dataclass(frozen=True)
class _Start:
    """Where a request's first leg goes, and as what."""

    worker_id: str
    message: type[AddRequests] | type[AddPrefill]
    request: EngineRequest


class Placement:
    """Routing policy over the ready workers, plus the open requests it placed.

    `workers` is the registry's live table (read only here). `admission_queue_size` is the
    per-worker headroom above `max_num_seqs` before a worker counts as overloaded.
    """

    def __init__(self, cluster: ClusterConfig, workers: Mapping[str, WorkerHandle], *,
                 block_size: int, admission_queue_size: int):
        self.cluster, self.workers = cluster, workers
        self.admission_queue_size = admission_queue_size
        self.index = KVIndex()
        self.router = Router(make_policy(cluster.router, cluster.prefill_weight,
                                         cluster.router_temperature), self.index,
                             LoadTracker(block_size))
        self.decode_policy = LeastLoad()
        self.counters = ClusterCounters()
        self.tracked: dict[str, Tracked] = {}

    @property
    def num_open(self) -> int:
        return len(self.tracked)

    # -- choosing workers (pure apart from the router's charges) -----------------------------

    def disaggregate(self, num_prompt_tokens: int) -> bool:
        """Remote prefill: a long prompt, and both a prefill and a decode worker are up."""
        if num_prompt_tokens < self.cluster.disagg_min_tokens:
            return False
        roles = {h.role for h in self.workers.values()}
        return "prefill" in roles and bool(roles & {"decode", "both"})

    def candidates(self, work: Work) -> list[Candidate]:
        """Ready workers for `work`; every ready worker if none fits."""
        handles = list(self.workers.values())
        fit = [h for h in handles if (h.can_prefill if work == "prefill" else h.can_decode)]
        return [Candidate(h.worker_id, self._overloaded(h)) for h in fit or handles]

    def _overloaded(self, h: WorkerHandle) -> bool:
        return (h.stats.num_waiting >= self.cluster.overload_waiting
                or self.router.loads.num_open(h.worker_id)
                >= h.info.max_num_seqs + self.admission_queue_size)

    def explain(self, prompt_token_ids: list[int], salt: str | None) -> Explanation:
        """The decision `place` would take for this prompt now; nothing changes. Needs at
        least one ready worker."""
        mode: Mode
        if self.disaggregate(len(prompt_token_ids)):
            mode, work = "disaggregated", "prefill"
        else:
            roles = {h.role for h in self.workers.values()}
            mode = "local-prefill" if "prefill" in roles else "aggregated"
            work = "decode"
        return Explanation(mode, self.router.explain(prompt_token_ids, salt,
                                                     self.candidates(work)))

    # -- placing requests ------------------------------------------------------------------

    def place(self, requests: list[EngineRequest], stream: OutputStream) -> list[Send]:
        """Track and route new requests (one group, one stream); one message per worker and
        kind. Needs at least one ready worker."""
        return _batched([self._start(Tracked(r, stream, "", Leg.LOCAL, salt=r.cache_salt))
                         for r in requests])

    def _start(self, t: Tracked) -> _Start:
        """Route `t` from its beginning (PREFILL or LOCAL) and track it."""
        prompt = t.request.prompt_token_ids
        t.leg = Leg.PREFILL if self.disaggregate(len(prompt)) else Leg.LOCAL
        work: Work = "prefill" if t.leg is Leg.PREFILL else "decode"
        decision = self.router.route(t.request_id, prompt, t.salt, self.candidates(work))
        t.worker = decision.chosen
        self.tracked[t.request_id] = t
        self.counters.record(decision)
        if t.leg is Leg.PREFILL:
            return _Start(decision.chosen, AddPrefill, prefill_request(t.request))
        return _Start(decision.chosen, AddRequests, t.request)

    def retry(self, t: Tracked) -> list[Send]:
        """Send `t` again from its beginning (its worker was lost before it delivered)."""
        t.attempts += 1
        self.counters.retries += 1
        return _batched([self._start(t)])

    def migrate(self, t: Tracked) -> list[Send]:
        """Resume `t` on a decode-capable worker from prompt + tokens so far."""
        t.attempts += 1
        self.counters.migrations += 1
        decision = self.router.route(t.request_id, t.resume_tokens(), t.salt,
                                     self.candidates("decode"))
        t.worker, t.leg = decision.chosen, Leg.LOCAL
        self.counters.decisions[decision.chosen] += 1
        return [Send(decision.chosen, AddRequests([t.continuation()]))]

    def _start_decode(self, t: Tracked, handle: KVHandle | None) -> list[Send]:
        """The DECODE leg after a prefill: least decode load; the prompt comes by transfer."""
        decision = self.router.route(t.request_id, t.resume_tokens(), t.salt,
                                     self.candidates("decode"), self.decode_policy,
                                     charge_prefill=False)
        t.worker, t.leg = decision.chosen, Leg.DECODE
        self.counters.handoffs += 1
        self.counters.decisions[decision.chosen] += 1
        return [Send(decision.chosen, AddDecode([DecodeItem(t.continuation(), handle)]))]

    # -- following requests ----------------------------------------------------------------

    def on_output(self, worker_id: str, out: EngineCoreOutput, max_model_len: int) -> None:
        """Deliver one output from `worker_id` to its stream, unless it is stale (the request
        moved on, or is between legs). A prefill leg's finish becomes a HANDOFF unless it
        ends the whole request."""
        t = self.tracked.get(out.request_id)
        if t is None or t.worker != worker_id or t.leg is Leg.HANDOFF:
            return
        out = t.absorb(out)
        if out.new_token_ids:
            self.router.loads.progressed(t.request_id, len(out.new_token_ids))
        if out.finished and t.leg is Leg.PREFILL and not t.prefill_completes(out, max_model_len):
            t.leg = Leg.HANDOFF  # the first token goes out now; PrefillDone follows
            out = without_finish(out)
        elif out.finished:
            self._untrack(t.request_id)
        t.stream.deliver(out)

    def on_prefill_done(self, worker_id: str, done: PrefillDone) -> list[Send]:
        """Start the DECODE leg of a request in HANDOFF, or free the held blocks of one that
        finished or was aborted meanwhile."""
        t = self.tracked.get(done.request_id)
        if t is None or t.worker != worker_id or t.leg is not Leg.HANDOFF:
            if done.handle is None:
                return []
            return [Send(worker_id, ReleaseKV([done.handle.handle_id]))]
        return self._start_decode(t, done.handle)

    def on_rejected(self, message: Rejected) -> None:
        """Fail each rejected request's stream; the rest of its group is aborted (through the
        stream's abort callback)."""
        for r in message.rejections:
            t = self.tracked.get(r.request_id)
            if t is None:
                continue
            t.stream.abort()
            t.stream.fail(RequestRejected(r.message, r.param, r.code))

    # -- ending requests -------------------------------------------------------------------

    def abort(self, request_ids: Iterable[str]) -> list[Send]:
        """Stop tracking the requests; the aborts for the workers running them (a request
        between legs runs nowhere)."""
        by_worker: dict[str, list[str]] = defaultdict(list)
        for rid in request_ids:
            t = self._untrack(rid)
            if t is not None and t.leg is not Leg.HANDOFF:
                by_worker[t.worker].append(rid)
        return [Send(worker_id, AbortRequests(ids)) for worker_id, ids in by_worker.items()]

    def fail_all(self, reason: str) -> list[Send]:
        """Abort every open request and fail its stream with WorkerLost(reason)."""
        streams = {id(t.stream): t.stream for t in self.tracked.values()}
        sends = self.abort(list(self.tracked))
        for stream in streams.values():
            stream.fail(WorkerLost(reason))
        return sends

    def fail_lost(self, t: Tracked, reason: str) -> list[Send]:
        """Fail `t`'s whole stream because its worker was lost (siblings are aborted)."""
        self.counters.lost += 1
        self._untrack(t.request_id)
        sends = self.abort([rid for rid in t.stream.open if rid in self.tracked])
        t.stream.fail(WorkerLost(reason))
        return sends

    def _untrack(self, request_id: str) -> Tracked | None:
        self.router.loads.release(request_id)
        return self.tracked.pop(request_id, None)

    # -- workers coming and going ------------------------------------------------------------

    def requests_on(self, worker_id: str) -> list[Tracked]:
        """The open requests whose current leg runs on `worker_id` (a snapshot)."""
        return [t for t in self.tracked.values() if t.worker == worker_id]

    def add_worker(self, worker_id: str) -> None:
        self.index.add_worker(worker_id)

    def forget_worker(self, worker_id: str) -> None:
        """Drop what the index and the load tracker know of a lost worker."""
        self.index.remove_worker(worker_id)
        self.router.loads.forget_worker(worker_id)

    # -- the KV index's feed (each returns a ResyncKV when the index lost track) ---------------

    def on_kv_events(self, batch: KVEventBatch) -> list[Send]:
        """Apply a batch from a worker's current incarnation."""
        if not self.index.apply(batch.worker_id, batch.seq, batch.events):
            return []
        log.info("KV event gap from %s at batch %d: resyncing", batch.worker_id, batch.seq)
        return [Send(batch.worker_id, ResyncKV())]

    def on_kv_snapshot(self, worker_id: str, snapshot: KVSnapshot) -> list[Send]:
        if self.index.load_snapshot(worker_id, snapshot.seq, snapshot.block_hashes):
            return [Send(worker_id, ResyncKV())]
        return []

    def on_kv_seq(self, worker_id: str, kv_event_seq: int, now: float) -> list[Send]:
        """The worker says it published up to batch `kv_event_seq` (from its stats)."""
        if self.index.note_published(worker_id, kv_event_seq, now):
            return [Send(worker_id, ResyncKV())]
        return []


def _batched(starts: list[_Start]) -> list[Send]:
    """One message per (worker, kind), requests in order."""
    groups: dict[tuple[str, type], list[EngineRequest]] = defaultdict(list)
    for s in starts:
        groups[(s.worker_id, s.message)].append(s.request)
    return [Send(worker_id, message(requests))
            for (worker_id, message), requests in groups.items()]
