"""`kiln worker`: an engine worker that joins a running gateway.

    kiln serve --cluster-address tcp://0.0.0.0:5555 --workers 1          # on machine A
    kiln worker --gateway tcp://A:5555 --role decode --threads 8 \\
        --transfer-host 0.0.0.0                                         # on machine B

The worker takes the same engine flags as `kiln serve` (the model must be the same
checkpoint: the gateway refuses a worker whose vocabulary, block size or context differs).
Its KV transfer socket binds --transfer-host, 127.0.0.1 unless told otherwise: give the
interface (or 0.0.0.0) where decode workers on other machines pull its blocks.
Set KILN_CLUSTER_TOKEN to the same secret on the gateway and every worker to keep strangers out.
SIGTERM makes the worker say Goodbye: the gateway moves its requests elsewhere at once.

An engine over several machines (docs/parallelism.md, "Across machines"): node 0 runs the
worker (`--nnodes N --node-rank 0 --dist-init-addr A:PORT`); every other node runs
`kiln worker` with the same flags, `--node-rank R` and no --gateway: its ranks only.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import socket

from kiln.config import WorkerConfig
from kiln.config_cli import add_flags, flags_given
from kiln.engine.cli import add_engine_flags, engine_config

# a transfer socket bound to every interface advertises the one that reaches the gateway
WILDCARD_HOSTS = ("0.0.0.0", "*", "::")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("worker", help="an engine worker that joins a running gateway",
                       description="Load the model and serve a gateway's requests "
                                   "(kiln serve --cluster-address) from this machine.")
    add_flags(p.add_argument_group("worker"), WorkerConfig,
              computed={"worker_id": "HOST-PID",
                        "advertise_host": "--transfer-host; with 0.0.0.0, the address this "
                                          "machine reaches the gateway from"})
    add_engine_flags(p)
    p.set_defaults(func=run)


def default_worker_id() -> str:
    return f"{socket.gethostname().replace('.', '-')}-{os.getpid()}"


def local_address_towards(gateway: str) -> str:
    """The IP this machine uses to reach `gateway` (no packet is sent)."""
    host, _, port = gateway.removeprefix("tcp://").rpartition(":")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, int(port)))
        return s.getsockname()[0]


def worker_config(args: argparse.Namespace) -> WorkerConfig:
    given = flags_given(args, WorkerConfig)
    if "gateway_address" not in given:
        raise ValueError("--gateway is required (but on a node of rank > 0, --node-rank R, "
                         "which runs only its ranks of node 0's engine)")
    if not given["gateway_address"].startswith("tcp://"):
        raise ValueError(f"--gateway must be tcp://HOST:PORT, got {given['gateway_address']!r}")
    config = WorkerConfig(engine=engine_config(args), **{"worker_id": default_worker_id(),
                                                         **given})
    if config.advertise_host is None and config.transfer_host in WILDCARD_HOSTS:
        return dataclasses.replace(
            config, advertise_host=local_address_towards(config.gateway_address))
    return config


def run(args: argparse.Namespace) -> int:
    from kiln.cluster.worker import Worker, run_worker

    engine = engine_config(args)
    if engine.parallel.node_rank > 0:  # several machines: this one runs only its ranks
        from kiln.distributed.cli import run_node
        from kiln.engine.core import resolve_model_path

        return run_node(resolve_model_path(engine.model.model), engine.parallel)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s worker %(levelname)s %(message)s")
    config = worker_config(args)

    def on_start(worker: Worker) -> None:
        def leave(sig: int, _frame) -> None:
            worker.goodbye = f"stopped by {signal.Signals(sig).name}"

        signal.signal(signal.SIGTERM, leave)
        signal.signal(signal.SIGINT, leave)

    logging.getLogger("kiln.worker").info("joining %s as %s (role %s)", config.gateway_address,
                                          config.worker_id, config.role)
    return run_worker(config, 0, on_start)
