"""The gateway's KV index: which worker holds which prefix-cache block, fed by KV events.

Pure bookkeeping, no I/O (the subscriber in kv_events.py feeds it; tests drive it by hand).
Each worker numbers its event batches 1, 2, 3, ...; the index applies them strictly in order.
A batch whose number skips ahead (a PUB socket dropped one, or the subscription was not up
yet) means the view of that worker is wrong: the index stops applying its batches, buffers
them, and says "resync" once; the caller asks the worker for a snapshot (every hash it holds,
as of batch S), `load_snapshot` replaces the worker's set and replays buffered batches after S.
A heartbeat carries the worker's latest batch number, so a gap is found even when the dropped
batch was the last one (`note_published`).

Queries: `overlap(hashes)` = for each worker, how many *leading* blocks of a prompt it holds
(block hashes are chained, so a worker holding block i without block i-1 cannot use it).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from kiln.engine.block_hash import BlockHash
from kiln.engine.prefix_cache import AllCleared, BlockRemoved, BlockStored, KVEvent

MAX_BUFFERED_BATCHES = 4096  # while a resync is pending; past this, ask again and drop them


@dataclass
class _WorkerView:
    hashes: set[BlockHash] = field(default_factory=set)
    last_seq: int | None = None  # last applied batch; None until the first snapshot
    resync_pending: bool = True
    buffered: list[tuple[int, list[KVEvent]]] = field(default_factory=list)
    lag_target: int | None = None  # a heartbeat said batches up to this exist...
    lag_since: float = 0.0  # ...at this time, and they had not all arrived


class KVIndex:
    """Block hash -> workers holding it, and worker -> its hashes."""

    def __init__(self, lag_grace_s: float = 2.0):
        self.lag_grace_s = lag_grace_s
        self._workers: dict[str, _WorkerView] = {}
        self._holders: dict[BlockHash, set[str]] = {}
        self.num_resyncs = 0  # resyncs asked for (a gap, a lag, a new worker)

    # -- membership ---------------------------------------------------------------------------

    def add_worker(self, worker: str) -> None:
        """Start tracking `worker` (empty, awaiting its first snapshot: the caller asks)."""
        self.remove_worker(worker)
        self._workers[worker] = _WorkerView()
        self.num_resyncs += 1

    def remove_worker(self, worker: str) -> None:
        """Forget everything `worker` held (it left or died)."""
        view = self._workers.pop(worker, None)
        if view is not None:
            self._drop_all(worker, view)

    def workers(self) -> list[str]:
        return list(self._workers)

    def num_blocks(self, worker: str) -> int:
        view = self._workers.get(worker)
        return len(view.hashes) if view else 0

    def last_seq(self, worker: str) -> int | None:
        view = self._workers.get(worker)
        return view.last_seq if view else None

    def resync_pending(self, worker: str) -> bool:
        view = self._workers.get(worker)
        return bool(view and view.resync_pending)

    # -- events ---------------------------------------------------------------------------------

    def apply(self, worker: str, seq: int, events: Sequence[KVEvent]) -> bool:
        """Apply batch `seq` of `worker`. True means: a gap was found, ask for a snapshot
        (returned once per gap; batches are buffered until the snapshot arrives)."""
        view = self._workers.get(worker)
        if view is None:
            return False
        if view.resync_pending:
            return self._buffer(view, seq, events)
        if seq <= view.last_seq:
            return False  # already applied (a duplicate)
        if seq != view.last_seq + 1:
            view.resync_pending = True
            self.num_resyncs += 1
            view.buffered = [(seq, list(events))]
            return True
        self._apply_events(worker, view, events)
        view.last_seq = seq
        return False

    def load_snapshot(self, worker: str, seq: int, hashes: Iterable[BlockHash]) -> bool:
        """Replace `worker`'s blocks with a snapshot taken after its batch `seq`, then replay
        buffered batches after `seq`. True if a gap remains (ask for another snapshot)."""
        view = self._workers.get(worker)
        if view is None:
            return False
        self._drop_all(worker, view)
        view.hashes = set(hashes)
        for h in view.hashes:
            self._holders.setdefault(h, set()).add(worker)
        view.last_seq, view.resync_pending = seq, False
        buffered, view.buffered = sorted(view.buffered, key=lambda b: b[0]), []
        for i, (batch_seq, events) in enumerate(buffered):
            if self.apply(worker, batch_seq, events):
                view.buffered.extend(buffered[i + 1:])
                return True
        return False

    def note_published(self, worker: str, seq: int, now: float) -> bool:
        """A heartbeat says `worker` has published batches up to `seq`. True when batches it
        published more than `lag_grace_s` ago have still not arrived: ask for a snapshot."""
        view = self._workers.get(worker)
        if view is None:
            return False
        if view.resync_pending or view.last_seq is None:
            view.lag_target = None  # a snapshot is on its way anyway
            return False
        if view.lag_target is not None and view.last_seq >= view.lag_target:
            view.lag_target = None
        if view.lag_target is None:
            if seq > view.last_seq:
                view.lag_target, view.lag_since = seq, now
            return False
        if now - view.lag_since < self.lag_grace_s:
            return False
        view.resync_pending, view.lag_target = True, None
        self.num_resyncs += 1
        return True

    def _buffer(self, view: _WorkerView, seq: int, events: Sequence[KVEvent]) -> bool:
        if len(view.buffered) >= MAX_BUFFERED_BATCHES:
            view.buffered = []
            self.num_resyncs += 1
            return True  # the snapshot never came: ask again
        view.buffered.append((seq, list(events)))
        return False

    def _apply_events(self, worker: str, view: _WorkerView, events: Sequence[KVEvent]) -> None:
        for event in events:
            if isinstance(event, BlockStored):
                for h in event.block_hashes:
                    view.hashes.add(h)
                    self._holders.setdefault(h, set()).add(worker)
            elif isinstance(event, BlockRemoved):
                for h in event.block_hashes:
                    view.hashes.discard(h)
                    self._unhold(h, worker)
            elif isinstance(event, AllCleared):
                self._drop_all(worker, view)

    def _drop_all(self, worker: str, view: _WorkerView) -> None:
        for h in view.hashes:
            self._unhold(h, worker)
        view.hashes = set()

    def _unhold(self, block_hash: BlockHash, worker: str) -> None:
        holders = self._holders.get(block_hash)
        if holders is not None:
            holders.discard(worker)
            if not holders:
                del self._holders[block_hash]

    # -- queries --------------------------------------------------------------------------------

    def overlap(self, hashes: Sequence[BlockHash],
                workers: Iterable[str] | None = None) -> dict[str, int]:
        """Leading blocks of `hashes` held by each worker (every tracked worker, or those
        given; a worker holding none maps to 0)."""
        counts = {w: 0 for w in (self._workers if workers is None else workers)}
        alive = {w for w in counts if w in self._workers}
        for depth, h in enumerate(hashes):
            alive &= self._holders.get(h, set())
            if not alive:
                break
            for w in alive:
                counts[w] = depth + 1
        return counts

    def holders(self, block_hash: BlockHash) -> set[str]:
        return set(self._holders.get(block_hash, ()))
