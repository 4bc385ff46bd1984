"""The gateway's KV index with hand-built event batches: exact overlaps, gaps, snapshots."""

from __future__ import annotations

from kiln.cluster.kv_index import KVIndex
from kiln.engine.prefix_cache import AllCleared, BlockRemoved, BlockStored

A, B, C, D = b"a" * 16, b"b" * 16, b"c" * 16, b"d" * 16


def stored(*hashes: bytes) -> BlockStored:
    return BlockStored(list(hashes), None, [], 16)


def synced(*workers: str) -> KVIndex:
    index = KVIndex(lag_grace_s=2.0)
    for w in workers:
        index.add_worker(w)
        index.load_snapshot(w, 0, [])
    return index


def test_overlap_counts_leading_blocks_per_worker():
    index = synced("w1", "w2", "w3")
    assert index.apply("w1", 1, [stored(A, B, C)]) is False
    assert index.apply("w2", 1, [stored(A, B)]) is False
    index.apply("w3", 1, [stored(B, C)])  # no A: it can use none of them
    assert index.overlap([A, B, C, D]) == {"w1": 3, "w2": 2, "w3": 0}
    index.apply("w1", 2, [BlockRemoved([B])])
    assert index.overlap([A, B, C, D]) == {"w1": 1, "w2": 2, "w3": 0}
    index.apply("w2", 2, [AllCleared()])
    assert index.overlap([A, B, C]) == {"w1": 1, "w2": 0, "w3": 0}
    assert index.overlap([A], ["w2", "gone"]) == {"w2": 0, "gone": 0}
    assert index.holders(C) == {"w1", "w3"}


def test_a_new_worker_waits_for_its_snapshot_then_replays():
    index = KVIndex()
    index.add_worker("w1")
    assert index.resync_pending("w1")
    assert index.apply("w1", 1, [stored(A)]) is False  # buffered: no snapshot yet
    assert index.apply("w1", 2, [stored(B)]) is False
    assert index.overlap([A, B]) == {"w1": 0}
    assert index.load_snapshot("w1", 1, [A]) is False  # batch 1 is in the snapshot
    assert index.overlap([A, B]) == {"w1": 2}
    assert index.last_seq("w1") == 2 and not index.resync_pending("w1")


def test_a_gap_asks_for_one_resync_and_buffers_until_the_snapshot():
    index = synced("w1")
    resyncs = index.num_resyncs
    index.apply("w1", 1, [stored(A)])
    assert index.apply("w1", 3, [stored(C)]) is True  # batch 2 never came
    assert index.apply("w1", 4, [stored(D)]) is False  # already asked: just buffer
    assert index.num_resyncs == resyncs + 1
    # the snapshot was taken after batch 3: it has A, B (from batch 2) and C
    assert index.load_snapshot("w1", 3, [A, B, C]) is False
    assert index.overlap([A, B, C, D]) == {"w1": 4}
    assert index.last_seq("w1") == 4


def test_a_gap_left_after_the_snapshot_asks_again():
    index = synced("w1")
    index.apply("w1", 2, [stored(B)])  # gap: 1 missing
    index.apply("w1", 5, [stored(D)])
    assert index.load_snapshot("w1", 3, [A, B]) is True  # 4 is missing too
    assert index.resync_pending("w1")


def test_duplicates_are_ignored():
    index = synced("w1")
    index.apply("w1", 1, [stored(A)])
    index.apply("w1", 2, [BlockRemoved([A])])
    assert index.apply("w1", 1, [stored(A)]) is False
    assert index.overlap([A]) == {"w1": 0}


def test_a_worker_that_leaves_is_forgotten():
    index = synced("w1", "w2")
    index.apply("w1", 1, [stored(A, B)])
    index.apply("w2", 1, [stored(A)])
    index.remove_worker("w1")
    assert index.holders(A) == {"w2"} and index.holders(B) == set()
    assert index.overlap([A, B]) == {"w2": 1}
    assert index.apply("w1", 2, [stored(C)]) is False  # late events of a gone worker
    assert index.workers() == ["w2"]


def test_a_lost_last_batch_is_found_by_the_heartbeat_sequence():
    index = synced("w1")
    index.apply("w1", 1, [stored(A)])
    assert index.note_published("w1", 1, now=0.0) is False  # caught up
    assert index.note_published("w1", 2, now=10.0) is False  # batch 2 may be in flight
    assert index.note_published("w1", 2, now=11.0) is False  # within the grace
    assert index.note_published("w1", 2, now=12.5) is True  # still missing: resync
    assert index.resync_pending("w1")


def test_the_heartbeat_lag_clears_once_the_batch_arrives():
    index = synced("w1")
    index.note_published("w1", 1, now=0.0)
    index.apply("w1", 1, [stored(A)])
    assert index.note_published("w1", 1, now=5.0) is False
    assert index.note_published("w1", 3, now=5.0) is False  # a new target
    index.apply("w1", 2, [stored(B)])
    index.apply("w1", 3, [stored(C)])
    assert index.note_published("w1", 3, now=9.0) is False
