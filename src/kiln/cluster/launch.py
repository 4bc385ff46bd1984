"""Building the gateway's ClusterClient from `kiln serve`'s configs: sockets and spawned slots."""

from __future__ import annotations

import os
from dataclasses import replace
from functools import partial

from kiln.cluster.cluster_client import ClusterClient
from kiln.cluster.registry import WorkerSlot
from kiln.cluster.transport import Endpoints
from kiln.cluster.worker import TOKEN_ENV, spawn_worker
from kiln.config import ClusterConfig, ServeConfig, WorkerConfig


def spawned_slots(cluster: ClusterConfig, worker: WorkerConfig, dial: str) -> list[WorkerSlot]:
    """One slot per worker `kiln serve` spawns: worker-i (role both), or prefill-i and
    decode-i when disaggregated."""
    if cluster.disaggregated:
        roles = [("prefill", "prefill", cluster.num_prefill_workers),
                 ("decode", "decode", cluster.num_decode_workers)]
    else:
        roles = [("worker", "both", cluster.num_workers)]
    slots = []
    for prefix, role, count in roles:
        for i in range(count):
            config = replace(worker, worker_id=f"{prefix}-{i}", role=role, gateway_address=dial,
                             parent_pid=os.getpid())
            slots.append(WorkerSlot(config.worker_id, role, partial(spawn_worker, config)))
    return slots


def build_cluster_client(serve: ServeConfig, worker: WorkerConfig) -> ClusterClient:
    """The gateway's client: the workers `serve.cluster` asks for (spawned with `worker`'s
    engine), plus any that join at `serve.cluster.address`."""
    cluster = serve.cluster
    endpoints = Endpoints.for_cluster(cluster.address)
    return ClusterClient(
        endpoints, spawned_slots(cluster, worker, endpoints.dial), cluster,
        block_size=worker.engine.cache.block_size, heartbeat_timeout_s=serve.heartbeat_timeout_s,
        start_timeout_s=serve.worker_start_timeout_s, restart=serve.restart_worker,
        admission_queue_size=serve.admission_queue_size, token=os.environ.get(TOKEN_ENV, ""))
