"""An engine worker: the engine core's step loop as a service on a ZMQ DEALER socket.

`python -m kiln.cluster.worker --config-json '<WorkerConfig as JSON>'` loads the engine,
connects to the gateway and sends `WorkerReady`. Then, forever: take every waiting command
without blocking (block only while the engine is idle, and then at most one heartbeat
interval), run one engine step, send that step's outputs as one `StepOutputs`, and send a
`Heartbeat` every interval, busy or idle (so silence means stuck). Sends never wait on the
gateway (no high-water mark: ZMQ queues them), so a slow gateway cannot stall the step loop.
The loop exits on `Shutdown`, when the parent process is gone, or (after sending
`WorkerFailed`) when the engine raises. Spawned by a gateway (`parent_pid` set), it ignores
SIGINT/SIGTERM: the gateway drains its requests first and then sends `Shutdown`.

In a cluster (`attach_kv`) the loop polls two more kinds of socket between steps: its KV
transfer ROUTER (decode workers pulling held blocks) and one DEALER per prefill worker it pulls
from; after each step it holds finished prefills' blocks (PrefillDone) and publishes the prefix
cache's KV events on its PUB socket (worker_kv.py, kv_events.py, transfer.py).

`spawn_worker` starts one as a child process; the gateway's client supervises it.

Fault injection (tests, chaos drills): `KILN_FAULT_STEP_DELAY_S=0.005` in the environment makes
every engine step take at least that much longer, so a request lasts long enough to cancel,
kill or drain whatever the model's speed.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import zmq

from kiln.assembly import build_engine_core
from kiln.cluster.messages import (
    AbortRequests,
    AddDecode,
    AddPrefill,
    AddRequests,
    Codec,
    Goodbye,
    Heartbeat,
    Rejected,
    Rejection,
    ReleaseKV,
    Reregister,
    ResyncKV,
    Shutdown,
    StepOutputs,
    Welcome,
    WorkerFailed,
    WorkerReady,
    WorkerStats,
    worker_identity,
)
from kiln.cluster.stats import expert_load_stats
from kiln.cluster.worker_kv import WorkerKV
from kiln.config import WorkerConfig
from kiln.engine.core import EngineCore, EngineRequest
from kiln.engine.limits import RequestError

log = logging.getLogger("kiln.worker")
STEP_DELAY_ENV = "KILN_FAULT_STEP_DELAY_S"
TOKEN_ENV = "KILN_CLUSTER_TOKEN"  # the shared secret a gateway may require of its workers


class Worker:
    """Owns one EngineCore and its sockets; `run()` is the whole life of the process.

    `kv` (a WorkerKV) is the cluster side: KV events, prefill holds, decode pulls. Without it
    (tests over a socket pair) the worker serves plain AddRequests only."""

    def __init__(self, config: WorkerConfig, engine: EngineCore, socket: zmq.Socket):
        self.config = config
        self.engine = engine
        self.socket = socket
        self.kv: WorkerKV | None = None
        self.codec = Codec()
        self.poller = zmq.Poller()
        self.poller.register(socket, zmq.POLLIN)
        self._stop = False
        self._incarnation = 0
        self._last_beat = 0.0
        self._num_steps = 0
        self._step_delay_s = float(os.environ.get(STEP_DELAY_ENV, "0") or 0)
        self.goodbye: str | None = None  # set to leave on purpose (kiln worker's SIGTERM)

    def attach_kv(self, kv: WorkerKV) -> None:
        """Join a cluster: KV events, prefill holds, decode pulls (before `run`)."""
        self.kv = kv
        self.poller.register(kv.server.socket, zmq.POLLIN)

    def add_requests(self, requests: list[EngineRequest]) -> None:
        """Add to the engine; refused requests are reported to the gateway as Rejected."""
        self._add(requests)

    def run(self, incarnation: int) -> None:
        self._incarnation = incarnation
        self._send(self._ready(incarnation))
        while not self._stop and self.goodbye is None:
            busy = self.engine.has_unfinished()
            self._poll(0 if busy else self._idle_wait_s())
            if self.engine.has_unfinished():
                self._step()
            self._housekeeping()
        if self.goodbye is not None:
            self._send(Goodbye(self.goodbye))

    def _housekeeping(self) -> None:
        if self.kv is not None:
            self.kv.expire(time.monotonic())
            self.kv.publish_events()
        if time.monotonic() - self._last_beat >= self.config.heartbeat_interval_s:
            self._send(Heartbeat(self.stats(with_expert_load=True)))
            self._last_beat = time.monotonic()
            self._check_parent()

    def _idle_wait_s(self) -> float:
        wait = self.config.heartbeat_interval_s
        deadline = self.kv.next_deadline() if self.kv is not None else None
        if deadline is not None:
            wait = min(wait, max(0.0, deadline - time.monotonic()))
        return wait

    def _ready(self, incarnation: int) -> WorkerReady:
        e, kv = self.engine, self.kv
        return WorkerReady(worker_id=self.config.worker_id, incarnation=incarnation,
                           pid=os.getpid(), model_path=e.model_path, limits=e.limits,
                           eos_token_ids=sorted(e.eos_token_ids),
                           max_num_seqs=e.config.scheduler.max_num_seqs, role=self.config.role,
                           transfer_address=kv.server.address if kv else None,
                           kv_layout=kv.layout if kv else None,
                           token=os.environ.get(TOKEN_ENV, ""))

    def _poll(self, timeout_s: float) -> None:
        ready = dict(self.poller.poll(int(timeout_s * 1000)))
        if self.socket in ready:
            self._take_commands()
        if self.kv is None:
            return
        if self.kv.server.socket in ready:
            while self.kv.server.serve_one():
                pass
        for sock in list(self.kv.client.sockets.values()):
            if sock in ready:
                self.kv.on_reply(sock)

    def _take_commands(self) -> None:
        while not self._stop:
            try:
                frame = self.socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._handle(frame)

    def _handle(self, frame: bytes) -> None:
        try:
            message = self.codec.decode_gateway_message(frame)
        except msgspec.MsgspecError as exc:
            log.warning("dropped a frame that is not a gateway message: %s", exc)
            return
        if isinstance(message, AddRequests):
            self._add(message.requests)
        elif isinstance(message, AbortRequests):
            self._abort(message.request_ids)
        elif isinstance(message, Shutdown):
            self._stop = True
            if message.reason:
                log.warning("the gateway sent us away: %s", message.reason)
        elif self.kv is not None:
            self._handle_cluster(message)

    def _handle_cluster(self, message) -> None:
        kv = self.kv
        if isinstance(message, AddPrefill):
            kv.add_prefill(message.requests)
        elif isinstance(message, AddDecode):
            for sock in kv.add_decode(message.items):
                self.poller.register(sock, zmq.POLLIN)
        elif isinstance(message, ReleaseKV):
            for handle_id in message.handle_ids:
                kv.server.release(handle_id)
        elif isinstance(message, ResyncKV):
            self._send(kv.snapshot())
        elif isinstance(message, Welcome):
            kv.events.connect(events_address(message.events_address,
                                             self.config.gateway_address))
        elif isinstance(message, Reregister):
            log.warning("the gateway does not know us (it restarted?): registering again")
            pulling = [pull.key for pull in kv.client.pulls.values()]
            self._abort(list(self.engine.scheduler.requests) + pulling)
            self._send(self._ready(self._incarnation))

    def _add(self, requests: list[EngineRequest]) -> None:
        rejected = []
        for req in requests:
            try:
                self.engine.add_request(req)
            except RequestError as exc:
                rejected.append(Rejection(req.request_id, str(exc), exc.param, exc.code))
            except ValueError as exc:  # e.g. a duplicate request id
                rejected.append(Rejection(req.request_id, str(exc)))
        if rejected:
            if self.kv is not None:
                self.kv.forget([r.request_id for r in rejected])
            self._send(Rejected(rejected))

    def _abort(self, request_ids: list[str]) -> None:
        self.engine.abort_requests(request_ids)
        if self.kv is not None:
            self.kv.abort(request_ids)

    def _step(self) -> None:
        outputs = self.engine.step()
        self._num_steps += 1
        if self._step_delay_s:
            time.sleep(self._step_delay_s)
        if outputs:
            self._send(StepOutputs(outputs, self.stats()))
        if self.kv is not None:
            for done in self.kv.after_step(outputs):
                self._send(done)

    def stats(self, with_expert_load: bool = False) -> WorkerStats:
        """The step's figures; `with_expert_load`: also the MoE layers' expert counters (a
        device read, so heartbeats only)."""
        kv, sched = self.engine.kv.stats(), self.engine.scheduler
        stats = WorkerStats(
            num_running=sched.num_running, num_waiting=sched.num_waiting,
            num_preemptions=sched.num_preemptions, kv_blocks_total=kv.num_blocks,
            kv_blocks_used=kv.used_blocks, kv_blocks_cached=kv.cached_blocks,
            prefix_query_tokens=kv.query_tokens, prefix_hit_tokens=kv.hit_tokens,
            num_steps=self._num_steps)
        if with_expert_load:
            stats.expert_load = expert_load_stats(self.engine.runner.model)
        if self.kv is not None:
            server = self.kv.server
            stats.kv_blocks_used -= server.num_blocks_held_only  # pinned, not used by requests
            stats.kv_event_seq, stats.kv_blocks_held = self.kv.events.seq, server.num_blocks_held
            stats.kv_transfers_ok, stats.kv_transfers_failed = self.kv.ok, self.kv.failed
            stats.kv_transfer_bytes, stats.kv_transfer_seconds = self.kv.bytes, self.kv.seconds
        return stats

    def _send(self, message) -> None:
        self.socket.send(self.codec.encode(message), copy=False)

    def _check_parent(self) -> None:
        if self.config.parent_pid is not None and os.getppid() != self.config.parent_pid:
            log.warning("the gateway (pid %d) is gone; exiting", self.config.parent_pid)
            self._stop = True

    def fail(self, exc: BaseException) -> None:
        """Tell the gateway the engine died (best effort) before the process exits."""
        try:
            self._send(WorkerFailed(f"{type(exc).__name__}: {exc}"))
        except zmq.ZMQError:
            pass


def events_address(address: str, gateway_address: str) -> str:
    """The gateway's KV event address as this worker must dial it: a wildcard host
    (tcp://0.0.0.0:P, tcp://*:P) becomes the host this worker reaches the gateway by."""
    host, _, port = address.removeprefix("tcp://").rpartition(":")
    if address.startswith("tcp://") and host in ("0.0.0.0", "*", "[::]", "::"):
        gateway_host = gateway_address.removeprefix("tcp://").rpartition(":")[0]
        return f"tcp://{gateway_host}:{port}"
    return address


def connect(config: WorkerConfig, incarnation: int) -> tuple[zmq.Context, zmq.Socket]:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, worker_identity(config.worker_id, incarnation))
    sock.setsockopt(zmq.SNDHWM, 0)  # never block the step loop on a slow gateway
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.connect(config.gateway_address)
    return ctx, sock


def run_worker(config: WorkerConfig, incarnation: int = 0,
               on_start: Callable[[Worker], None] | None = None) -> int:
    """Load the engine, serve until told to stop; the process exit status. `on_start` gets
    the worker before it runs (kiln worker wires SIGTERM to `worker.goodbye` there)."""
    engine = build_engine_core(config.engine, emit_kv_events=True)
    ctx, sock = connect(config, incarnation)
    worker = Worker(config, engine, sock)
    try:
        worker.attach_kv(WorkerKV(engine, ctx, config.worker_id, incarnation,
                                  config.transfer_host, config.advertise_host,
                                  config.pull_timeout_s, config.hold_timeout_s,
                                  worker.add_requests))
        if on_start is not None:
            on_start(worker)
        worker.run(incarnation)
    except Exception as exc:
        log.exception("engine step failed")
        worker.fail(exc)
        return 1
    finally:
        if worker.kv is not None:
            worker.kv.close()
        sock.close()
        ctx.term()
    return 0


# -- launching as a child process ------------------------------------------------------------

@dataclass
class WorkerProcess:
    """A worker this process spawned (the gateway supervises it through this handle)."""

    process: subprocess.Popen
    incarnation: int

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        if self.alive:
            self.process.kill()
        self.process.wait()

    def join(self, timeout_s: float) -> None:
        """Wait for it to exit (after a Shutdown message), then SIGKILL."""
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()


def spawn_worker(config: WorkerConfig, incarnation: int) -> WorkerProcess:
    """Start `python -m kiln.cluster.worker` with `config`; returns at once (it loads async).
    OpenMP keeps its default wait policy (spin briefly, then sleep): PASSIVE (sleep at once)
    halved batch-1 decode on a 2-core machine, since every op then waits for threads to wake.
    Threads are left unpinned unless the environment pins them: a pinned main thread passes
    its one core to every thread it starts later (ZMQ's I/O thread, the grammar compiler's
    pool), which then preempt OpenMP thread 0 while the others spin at the barrier, and the
    gateway and clients share the cores too (docs/decisions/0012). Tensor-parallel ranks get
    cores // ranks threads each, unpinned (kiln.distributed.launch)."""
    env = dict(os.environ)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    cmd = [sys.executable, "-m", "kiln.cluster.worker", "--config-json",
           msgspec.json.encode(config).decode(), "--incarnation", str(incarnation)]
    return WorkerProcess(subprocess.Popen(cmd, env=env), incarnation)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kiln.cluster.worker")
    parser.add_argument("--config-json", required=True, help="WorkerConfig as JSON")
    parser.add_argument("--incarnation", type=int, default=0, help="restart count")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s worker %(levelname)s %(message)s")
    config = msgspec.json.decode(args.config_json, type=WorkerConfig)
    if config.parent_pid is None:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    else:  # the gateway drains first, then says Shutdown; a terminal's ^C is for it alone
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    return run_worker(config, args.incarnation)


if __name__ == "__main__":
    sys.exit(main())
