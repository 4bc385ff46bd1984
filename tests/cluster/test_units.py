"""Small pure pieces: tenant salts, event addresses, summed stats, spawned worker slots."""

from __future__ import annotations

from kiln.cluster.launch import Endpoints, spawned_slots
from kiln.cluster.messages import WorkerStats
from kiln.cluster.stats import sum_stats
from kiln.cluster.worker import events_address
from kiln.config import ClusterConfig, WorkerConfig
from kiln.serve.auth import KeyStore


def test_each_key_gets_its_own_stable_salt_and_a_restart_draws_new_ones():
    store = KeyStore(("key-a", "key-b"))
    a, b = store.salt_for("key-a"), store.salt_for("key-b")
    assert a == store.salt_for("key-a") and a != b and len(a) == 32
    assert "key-a" not in a and KeyStore(("key-a",)).salt_for("key-a") != a


def test_a_wildcard_event_address_is_dialled_at_the_gateway_host():
    assert events_address("tcp://0.0.0.0:5556", "tcp://10.0.0.7:5555") == "tcp://10.0.0.7:5556"
    assert events_address("tcp://10.0.0.9:5556", "tcp://gw:5555") == "tcp://10.0.0.9:5556"
    assert events_address("ipc:///tmp/x-events.sock", "ipc:///tmp/x.sock") == \
        "ipc:///tmp/x-events.sock"


def test_endpoints_for_tcp_and_ipc():
    e = Endpoints.for_cluster("tcp://0.0.0.0:5555")
    assert (e.router, e.events, e.dial) == ("tcp://0.0.0.0:5555", "tcp://0.0.0.0:5556",
                                            "tcp://127.0.0.1:5555")
    local = Endpoints.for_cluster(None)
    assert local.router.startswith("ipc://") and local.events.endswith("-events.sock")


def test_spawned_slots_name_roles():
    worker = WorkerConfig()
    slots = spawned_slots(ClusterConfig(num_prefill_workers=1, num_decode_workers=2), worker,
                          "ipc:///x")
    assert [(s.worker_id, s.role) for s in slots] == [
        ("prefill-0", "prefill"), ("decode-0", "decode"), ("decode-1", "decode")]
    assert [s.worker_id for s in spawned_slots(ClusterConfig(num_workers=2), worker, "x")] == \
        ["worker-0", "worker-1"]


def test_stats_sum_field_by_field():
    total = sum_stats([WorkerStats(num_running=2, kv_blocks_used=5, kv_transfer_seconds=0.5),
                       WorkerStats(num_running=1, kv_blocks_used=7, kv_transfer_seconds=0.25)])
    assert (total.num_running, total.kv_blocks_used, total.kv_transfer_seconds) == (3, 12, 0.75)
