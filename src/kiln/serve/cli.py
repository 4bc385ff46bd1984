"""`kiln serve`: flags -> ServeConfig + WorkerConfig -> kiln.serve.server.serve.

Every flag but the engine's speculator names is a field of ServeConfig, ClusterConfig,
WorkerConfig or the engine's configs (kiln.config_cli), with its default and help there.
"""

from __future__ import annotations

import argparse
import logging

from kiln.config import ClusterConfig, ServeConfig, WorkerConfig, default_num_threads
from kiln.config_cli import add_flags, config_from_flags
from kiln.engine.cli import add_engine_flags, engine_config

# WorkerConfig's fields the gateway sets for each worker it spawns (kiln.cluster.launch)
PER_WORKER = ("gateway_address", "worker_id", "role", "transfer_host", "advertise_host")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server over an engine worker",
                       description="Serve a model over an OpenAI-compatible HTTP API.")
    add_engine_flags(p, threads_default="the cores split among the workers spawned here")
    add_flags(p.add_argument_group("engine worker"), WorkerConfig, skip=PER_WORKER)
    add_flags(p.add_argument_group("gateway"), ServeConfig)
    add_flags(p.add_argument_group("cluster (many workers: kiln.cluster)"), ClusterConfig)
    p.set_defaults(func=run)


def configs(args: argparse.Namespace) -> tuple[ServeConfig, WorkerConfig]:
    cluster = config_from_flags(args, ClusterConfig)
    engine = engine_config(args, threads_per_worker(cluster.num_spawned))
    return (config_from_flags(args, ServeConfig, cluster=cluster),
            config_from_flags(args, WorkerConfig, engine=engine))


def threads_per_worker(num_workers: int) -> int | None:
    """Workers sharing this machine split its cores (None: one worker takes them all)."""
    return max(1, default_num_threads() // num_workers) if num_workers > 1 else None


def run(args: argparse.Namespace) -> int:
    from kiln.serve.server import serve

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    serve_config, worker_config = configs(args)
    return serve(serve_config, worker_config)
