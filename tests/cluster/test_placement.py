"""Placement and supervision without sockets: hand-built workers, exact sends, the
PREFILL -> HANDOFF -> DECODE flow, and what happens to a lost worker's requests."""

from __future__ import annotations

import pytest

from kiln.cluster.engine_client import OutputStream, RequestRejected, WorkerLost
from kiln.cluster.messages import (
    AbortRequests,
    AddDecode,
    AddPrefill,
    AddRequests,
    DecodeItem,
    KVEventBatch,
    KVHandle,
    KVSnapshot,
    PrefillDone,
    Rejected,
    Rejection,
    ReleaseKV,
    Reregister,
    ResyncKV,
    Shutdown,
    Welcome,
    WorkerReady,
)
from kiln.cluster.migration import Leg
from kiln.cluster.placement import Placement, Send
from kiln.cluster.registry import Registry, WorkerSlot
from kiln.cluster.supervision import Supervisor
from kiln.cluster.transport import Endpoints, Peer
from kiln.config import ClusterConfig
from kiln.engine.contract import EngineCoreOutput
from kiln.engine.core import EngineRequest
from kiln.engine.limits import EngineLimits
from kiln.sampling_params import SamplingParams

LIMITS = EngineLimits(max_model_len=64, vocab_size=100, block_size=4, num_kv_blocks=32)


def ready(worker_id: str, role: str = "both", incarnation: int = 0,
          limits: EngineLimits = LIMITS) -> WorkerReady:
    return WorkerReady(worker_id=worker_id, incarnation=incarnation, pid=1, model_path="m",
                       limits=limits, eos_token_ids=[0], max_num_seqs=4, role=role)


def request(rid: str, n: int = 6, max_tokens: int = 8) -> EngineRequest:
    return EngineRequest(request_id=rid, prompt_token_ids=list(range(1, n + 1)),
                         params=SamplingParams(max_tokens=max_tokens))


def placement(*workers: WorkerReady, **cluster) -> tuple[Placement, Registry]:
    registry = Registry([], heartbeat_timeout_s=1.0, start_timeout_s=1.0)
    p = Placement(ClusterConfig(**cluster), registry.workers, block_size=4,
                  admission_queue_size=2)
    for info in workers:
        registry.register(info)
        p.add_worker(info.worker_id)
    return p, registry


def stream_of(*requests: EngineRequest, aborted: list | None = None) -> OutputStream:
    return OutputStream([r.request_id for r in requests],
                        (aborted if aborted is not None else []).extend)


def test_a_group_is_routed_per_request_and_sent_once_per_worker():
    p, _ = placement(ready("w0"), ready("w1"), router="round-robin")
    rs = [request("a"), request("b"), request("c")]
    sends = p.place(rs, stream_of(*rs))
    assert sends == [Send("w0", AddRequests([rs[0], rs[2]])), Send("w1", AddRequests([rs[1]]))]
    assert dict(p.counters.decisions) == {"w0": 2, "w1": 1}
    assert [(t.worker, t.leg) for t in p.tracked.values()] == \
        [("w0", Leg.LOCAL), ("w1", Leg.LOCAL), ("w0", Leg.LOCAL)]
    assert p.router.loads.num_open("w0") == 2


def test_explain_routes_nothing():
    p, _ = placement(ready("w0"), ready("w1"), router="round-robin")
    first = p.explain([1, 2, 3, 4, 5, 6], None)
    assert (first.mode, first.decision.chosen) == ("aggregated", "w0")
    assert p.explain([1, 2, 3, 4, 5, 6], None).decision.chosen == "w0"
    assert p.num_open == 0 and p.router.loads.num_open("w0") == 0


def test_a_long_prompt_goes_prefill_handoff_decode():
    p, _ = placement(ready("p", "prefill"), ready("d", "decode"), disagg_min_tokens=6)
    r = request("r", n=9)
    stream = stream_of(r)
    [prefill] = p.place([r], stream)
    assert prefill.worker_id == "p" and isinstance(prefill.message, AddPrefill)
    assert prefill.message.requests[0].params.max_tokens == 1

    p.on_output("p", EngineCoreOutput("r", [42], finish_reason="length"), LIMITS.max_model_len)
    assert p.tracked["r"].leg is Leg.HANDOFF and stream._buffer[-1].finish_reason is None
    p.on_output("p", EngineCoreOutput("r", [43]), LIMITS.max_model_len)  # stale: between legs
    assert stream._buffer[-1].new_token_ids == [42]

    handle = KVHandle("h1", "tcp://p:1", "p", [b"x", b"y"])
    [decode] = p.on_prefill_done("p", PrefillDone("r", handle))
    assert decode == Send("d", AddDecode([DecodeItem(p.tracked["r"].continuation(), handle)]))
    assert decode.message.items[0].request.output_token_ids == [42]
    assert (p.tracked["r"].worker, p.tracked["r"].leg, p.counters.handoffs) == \
        ("d", Leg.DECODE, 1)

    p.on_output("d", EngineCoreOutput("r", [44], finish_reason="stop"), LIMITS.max_model_len)
    assert p.num_open == 0 and not stream.open and p.router.loads.num_open("d") == 0


def test_a_short_prompt_runs_on_a_decode_worker_and_explain_says_so():
    p, _ = placement(ready("p", "prefill"), ready("d", "decode"), disagg_min_tokens=6)
    r = request("r", n=5)
    assert p.place([r], stream_of(r)) == [Send("d", AddRequests([r]))]
    assert p.explain([1, 2, 3, 4, 5], None).mode == "local-prefill"
    assert p.explain(list(range(1, 10)), None).mode == "disaggregated"


def test_a_prefill_done_nobody_waits_for_frees_its_blocks():
    p, _ = placement(ready("p", "prefill"), ready("d", "decode"))
    handle = KVHandle("h1", "tcp://p:1", "p", [b"x"])
    assert p.on_prefill_done("p", PrefillDone("gone", handle)) == \
        [Send("p", ReleaseKV(["h1"]))]
    assert p.on_prefill_done("p", PrefillDone("gone", None)) == []


def test_abort_tells_the_worker_running_each_leg_and_none_for_a_handoff():
    p, _ = placement(ready("w0"), ready("w1"), router="round-robin")
    rs = [request("a"), request("b"), request("c")]
    p.place(rs, stream_of(*rs))
    p.tracked["c"].leg = Leg.HANDOFF
    assert p.abort(["a", "b", "c", "unknown"]) == \
        [Send("w0", AbortRequests(["a"])), Send("w1", AbortRequests(["b"]))]
    assert p.num_open == 0 and p.router.loads.num_open("w0") == 0


def test_a_rejection_fails_the_stream_and_aborts_the_rest_of_its_group():
    p, _ = placement(ready("w0"))
    rs = [request("a"), request("b")]
    aborted: list[str] = []
    stream = stream_of(*rs, aborted=aborted)
    p.place(rs, stream)
    p.on_rejected(Rejected([Rejection("a", "too long", "max_tokens", "bad")]))
    assert sorted(aborted) == ["a", "b"]
    assert isinstance(stream._error, RequestRejected) and stream._error.param == "max_tokens"


def test_the_kv_feed_asks_for_a_snapshot_on_a_gap_or_a_lag():
    p, _ = placement(ready("w0"), ready("w1"))
    assert p.on_kv_snapshot("w0", KVSnapshot(1, [])) == []
    assert p.on_kv_events(KVEventBatch("w0", 0, 3, [])) == [Send("w0", ResyncKV())]  # 2 lost
    assert p.on_kv_snapshot("w1", KVSnapshot(1, [])) == []
    assert p.on_kv_seq("w1", 2, now=0.0) == []
    assert p.on_kv_seq("w1", 2, now=5.0) == [Send("w1", ResyncKV())]  # 2 never came


# -- supervision ----------------------------------------------------------------------------

class FakeTransport:
    """An `Outbox` that records what supervision sends; every identity is reachable unless
    listed."""

    def __init__(self, unreachable: tuple[bytes, ...] = ()):
        self.endpoints = Endpoints("ipc:///r", "ipc:///e", "ipc:///r")
        self.sent: list[tuple[bytes, object]] = []
        self.unreachable = unreachable

    def send(self, identity: bytes, message) -> bool:
        if identity in self.unreachable:
            return False
        self.sent.append((identity, message))
        return True


def supervisor(*workers: WorkerReady, transport: FakeTransport | None = None,
               slots: list[WorkerSlot] | None = None, **cluster) -> Supervisor:
    config = ClusterConfig(**cluster)
    registry = Registry(slots or [], heartbeat_timeout_s=1.0, start_timeout_s=1.0, token="")
    p = Placement(config, registry.workers, block_size=4, admission_queue_size=2)
    s = Supervisor(registry, transport or FakeTransport(), p, config, restart=True)
    for info in workers:
        s.on_ready(Peer(f"{info.worker_id}.0".encode(), info.worker_id, 0), info)
    s.transport.sent.clear()
    return s


def test_registration_welcomes_and_refuses_a_different_model():
    s = supervisor()
    s.on_ready(Peer(b"w0.0", "w0", 0), ready("w0"))
    assert s.transport.sent == [(b"w0.0", Welcome("ipc:///e")), (b"w0.0", ResyncKV())]
    assert s.ready and s.limits == LIMITS
    other = EngineLimits(max_model_len=64, vocab_size=100, block_size=8, num_kv_blocks=32)
    s.on_ready(Peer(b"w1.0", "w1", 0), ready("w1", limits=other))
    assert isinstance(s.transport.sent[-1][1], Shutdown) and "w1" not in s.registry.workers


def test_a_stranger_is_asked_to_register_and_a_stale_incarnation_is_ignored():
    slot = WorkerSlot("worker-0", "both", launch=lambda i: None, incarnation=1)
    s = supervisor(slots=[slot])
    assert s.heard_from(Peer(b"joined.3", "joined", 3)) is None
    assert s.transport.sent == [(b"joined.3", Reregister())]
    assert s.heard_from(Peer(b"worker-0.0", "worker-0", 0)) is None  # an old process
    assert len(s.transport.sent) == 1


def test_an_unreachable_worker_is_marked_for_the_watchdog():
    s = supervisor(ready("w0"), transport=FakeTransport(unreachable=(b"w0.0",)))
    assert not s.send("w0", ResyncKV())
    assert s.registry.failures(now=0.0) == [("w0", "the engine worker w0 is unreachable")]


def test_a_lost_workers_requests_are_retried_or_migrated_elsewhere():
    s = supervisor(ready("w0"), ready("w1"), router="round-robin")
    rs = [request("fresh"), request("x"), request("streamed")]
    stream = stream_of(*rs)
    s.send_all(s.placement.place(rs, stream))
    s.placement.on_output("w0", EngineCoreOutput("streamed", [7, 8]), LIMITS.max_model_len)
    s.transport.sent.clear()

    s.remove("w0", "the engine worker w0 exited")
    assert s.transport.sent == [
        (b"w1.0", AddRequests([rs[0]])),
        (b"w1.0", AddRequests([s.placement.tracked["streamed"].continuation()]))]
    assert s.transport.sent[1][1].requests[0].output_token_ids == [7, 8]
    c = s.placement.counters
    assert (c.retries, c.migrations, c.lost) == (1, 1, 0)
    assert {t.worker for t in s.placement.tracked.values()} == {"w1"}


@pytest.mark.parametrize(("cluster", "workers", "delivered"), [
    ({"migration": False}, 2, [7]),  # streamed, migration off
    ({"max_migrations": 0}, 2, [7]),  # no attempts left
    ({}, 1, []),  # would be retried, but no worker is left
])
def test_a_request_that_cannot_go_on_fails_with_worker_lost(cluster, workers, delivered):
    s = supervisor(*(ready(f"w{i}") for i in range(workers)), **cluster)
    r = request("r")
    stream = stream_of(r)
    s.send_all(s.placement.place([r], stream))
    worker = s.placement.tracked["r"].worker
    s.placement.on_output(worker, EngineCoreOutput("r", delivered), LIMITS.max_model_len)
    s.remove(worker, "lost it")
    assert isinstance(stream._error, WorkerLost) and str(stream._error) == "lost it"
    assert s.placement.num_open == 0 and s.placement.counters.lost == 1


def test_a_request_failed_with_its_sibling_is_not_retried():
    s = supervisor(ready("w0"), ready("w1"), router="round-robin")
    rs = [request("a"), request("b"), request("c")]  # a and c on w0
    stream = stream_of(*rs)
    s.send_all(s.placement.place(rs, stream))
    s.placement.tracked["a"].delivered_prompt_logprobs = True  # cannot be resumed: fails
    s.transport.sent.clear()
    s.remove("w0", "gone")
    assert s.transport.sent == [(b"w1.0", AbortRequests(["b"]))]  # c is failed, not retried
    assert s.placement.num_open == 0 and s.placement.counters.retries == 0


def test_a_lost_slot_restarts_after_a_doubling_backoff_or_gives_up():
    slot = WorkerSlot("worker-0", "both", launch=lambda i: None)
    slot.lost(restart=True, now=10.0)
    slot.lost(restart=True, now=20.0)
    assert (slot.restart_at, slot.backoff_s, slot.dead) == (20.0 + 1.0, 2.0, False)
    slot.lost(restart=False, now=30.0)
    assert slot.dead
