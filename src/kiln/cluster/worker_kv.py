"""A worker's KV side in a cluster: event publishing, prefill holds, decode pulls and imports.

`WorkerKV` sits between the worker loop (worker.py: sockets, steps) and the engine's KV cache
manager and runner. Its contracts:

  prefill  `add_prefill` marks requests; `after_step` holds the full prompt blocks of each
           one that finished (not aborted) and returns a PrefillDone for it.
  decode   `add_decode` either adds the request at once (nothing to pull: no handle, or the
           blocks are already cached here) or starts a pull; the request is added to the
           engine when the pull ends, however it ends: imported (the prefix cache then hits),
           or failed / timed out / invalid (the engine recomputes the prompt). Every pull ends
           with a ReleaseBlocks to the prefill worker. Invalid bytes never reach the cache.
  abort    a request still waiting for its pull is dropped (and the blocks released).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import zmq

from kiln.cluster.kv_events import EventPublisher
from kiln.cluster.messages import DecodeItem, KVHandle, KVLayout, KVSnapshot, PrefillDone
from kiln.cluster.transfer import Pull, TransferClient, TransferError, TransferServer, check_payload
from kiln.engine.block_hash import hash_prompt_blocks
from kiln.engine.contract import EngineCoreOutput
from kiln.engine.core import EngineCore, EngineRequest
from kiln.runner import kv_io

log = logging.getLogger("kiln.worker")


def engine_layout(engine: EngineCore) -> KVLayout:
    spec = engine.runner.kv_spec
    return KVLayout(kv_io.DTYPE_NAMES[spec.dtype], spec.num_layers, spec.block_size,
                    spec.num_kv_heads, spec.head_dim, spec.holds.value)


class WorkerKV:
    def __init__(self, engine: EngineCore, ctx: zmq.Context, worker_id: str, incarnation: int,
                 transfer_host: str, advertise_host: str | None, pull_timeout_s: float,
                 hold_timeout_s: float, add: Callable[[list[EngineRequest]], None]):
        self.engine, self.kv = engine, engine.kv
        self.layout = engine_layout(engine)
        self.events = EventPublisher(ctx, worker_id, incarnation)
        self.server = TransferServer(ctx, transfer_host, worker_id, self.layout, self._export,
                                     self.kv.release_held, hold_timeout_s, advertise_host)
        self.client = TransferClient(ctx, pull_timeout_s)
        self._add = add  # the worker's own add (it reports rejections)
        self._prefill: dict[str, EngineRequest] = {}
        self.ok = self.failed = self.bytes = 0
        self.seconds = 0.0

    # -- prefill side ---------------------------------------------------------------------------

    def add_prefill(self, requests: list[EngineRequest]) -> None:
        self._prefill.update((r.request_id, r) for r in requests)
        self._add(requests)

    def after_step(self, outputs: list[EngineCoreOutput]) -> list[PrefillDone]:
        """Hold the blocks of prefill requests that just finished (call right after the
        step: their blocks were freed into the pool but nothing has reused them yet)."""
        done = []
        for out in outputs:
            req = self._prefill.pop(out.request_id, None) if out.finished else None
            if req is not None and out.finish_reason not in ("abort", "error"):
                done.append(PrefillDone(out.request_id, self._hold(req)))
        return done

    def publish_events(self) -> None:
        self.events.publish(self.kv.prefix_cache)

    def forget(self, request_ids: list[str]) -> None:
        """Requests rejected by the engine: nothing to hold."""
        for rid in request_ids:
            self._prefill.pop(rid, None)

    def _hold(self, req: EngineRequest) -> KVHandle | None:
        hashes = hash_prompt_blocks(req.prompt_token_ids, self.kv.block_size, req.cache_salt)
        blocks = self.kv.hold_cached(hashes)
        if not blocks:
            return None
        return self.server.hold(blocks, hashes[:len(blocks)])

    def _export(self, blocks: list) -> memoryview:
        data = kv_io.export_blocks(self.engine.runner.kv_caches, [b.block_id for b in blocks],
                                   self.kv.block_size)
        return kv_io.as_bytes(data)

    # -- decode side ----------------------------------------------------------------------------

    def add_decode(self, items: list[DecodeItem]) -> list[zmq.Socket]:
        """Add what needs no pull; start pulls for the rest. Returns sockets new to the poller."""
        now_ready, new_sockets = [], []
        for item in items:
            source = item.source
            start = self.kv.num_cached_prefix(source.block_hashes) if source else 0
            if source is None or start == len(source.block_hashes) or not self.kv.caching:
                if source is not None:
                    self.client.release(source)
                now_ready.append(item.request)
                continue
            sock = self.client.pull(item.request.request_id, source, start, item.request)
            if sock is not None:
                new_sockets.append(sock)
        if now_ready:
            self._add(now_ready)
        return new_sockets

    def on_reply(self, sock: zmq.Socket) -> None:
        """Finish every pull whose reply waits on `sock`."""
        while True:
            try:
                pull, header, payload, error = self.client.take_reply(sock)
            except zmq.Again:
                return
            except KeyError:
                continue  # a late reply to a pull that timed out or was aborted
            try:
                if header is None:
                    raise TransferError(error)
                data = check_payload(header, payload, self.layout, pull.expected_hashes)
                self._import(pull, data, len(payload))
            except TransferError as exc:
                self._failed(pull, str(exc))
            self._finish(pull)

    def _import(self, pull: Pull, data, nbytes: int) -> None:
        blocks = self.kv.allocate_for_import(len(pull.expected_hashes))
        if blocks is None:
            raise TransferError("no free KV blocks to import into")
        kv_io.import_blocks(self.engine.runner.kv_caches, [b.block_id for b in blocks],
                            self.kv.block_size, data)
        bs, start = self.kv.block_size, pull.start_block
        req: EngineRequest = pull.context
        parent = pull.handle.block_hashes[start - 1] if start else None
        tokens = req.prompt_token_ids[start * bs:(start + len(blocks)) * bs]
        self.kv.register_imported(blocks, pull.expected_hashes, parent, tokens)
        self.ok += 1
        self.bytes += nbytes
        self.seconds += time.monotonic() - pull.started

    def _failed(self, pull: Pull, reason: str) -> None:
        self.failed += 1
        log.warning("KV pull for %s failed (%s); recomputing its prompt", pull.key, reason)

    def _finish(self, pull: Pull) -> None:
        self.client.release(pull.handle)
        self._add([pull.context])

    def expire(self, now: float) -> None:
        """Give up on late pulls (recompute) and free holds nobody pulled."""
        for pull in self.client.expired(now):
            self._failed(pull, "timed out")
            self._finish(pull)
        self.server.expire(now)

    def abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._prefill.pop(rid, None)
            pull = self.client.cancel(rid)
            if pull is not None:
                self.client.release(pull.handle)

    def next_deadline(self) -> float | None:
        deadlines = [d for d in (self.client.next_deadline(), self.server.next_deadline()) if d]
        return min(deadlines, default=None)

    def snapshot(self) -> KVSnapshot:
        return self.events.snapshot(self.kv.prefix_cache)

    def close(self) -> None:
        self.server.close()
        self.client.close()
        self.events.close()
