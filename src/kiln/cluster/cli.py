"""`kiln worker`: an engine worker that joins a running gateway, and the cluster flags of
`kiln serve` (--workers, --prefill-workers/--decode-workers, --router, ...).

    kiln serve --cluster-address tcp://0.0.0.0:5555 --workers 1          # on machine A
    kiln worker --gateway tcp://A:5555 --role decode --threads 8         # on machine B

The worker takes the same engine flags as `kiln serve` (the model must be the same
checkpoint: the gateway refuses a worker whose vocabulary, block size or context differs).
Set KILN_CLUSTER_TOKEN to the same secret on the gateway and every worker to keep strangers out.
SIGTERM makes the worker say Goodbye: the gateway moves its requests elsewhere at once.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket

from kiln.config import ClusterConfig, WorkerConfig, default_num_threads

DEFAULTS = ClusterConfig()


def add_cluster_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--workers", type=int, default=DEFAULTS.num_workers,
                   help="aggregated workers to spawn (0: only workers that join)")
    g.add_argument("--prefill-workers", type=int, default=0,
                   help="disaggregated: prefill workers to spawn (with --decode-workers)")
    g.add_argument("--decode-workers", type=int, default=0,
                   help="disaggregated: decode workers to spawn (with --prefill-workers)")
    g.add_argument("--router", default=DEFAULTS.router,
                   choices=["round-robin", "least-load", "kv-aware"],
                   help="how a request picks its worker (default kv-aware)")
    g.add_argument("--router-temperature", type=float, default=DEFAULTS.router_temperature,
                   help="kv-aware: 0 = cheapest worker; > 0 samples by softmax of -cost / T")
    g.add_argument("--prefill-weight", type=float, default=DEFAULTS.prefill_weight,
                   help="kv-aware: cost of an uncached prompt block vs a held KV block")
    g.add_argument("--disagg-min-tokens", type=int, default=DEFAULTS.disagg_min_tokens,
                   help="shorter prompts prefill on the decode worker (no transfer)")
    g.add_argument("--no-migration", action="store_true",
                   help="a stream whose worker dies ends with an error event (no resume)")
    g.add_argument("--max-migrations", type=int, default=DEFAULTS.max_migrations,
                   help="retries + migrations per request before it fails")
    g.add_argument("--cluster-address", default=None,
                   help="tcp://HOST:PORT to bind for `kiln worker` joins (events on PORT+1)")


def cluster_config(args: argparse.Namespace) -> ClusterConfig:
    return ClusterConfig(
        num_workers=args.workers, num_prefill_workers=args.prefill_workers,
        num_decode_workers=args.decode_workers, router=args.router,
        router_temperature=args.router_temperature, prefill_weight=args.prefill_weight,
        disagg_min_tokens=args.disagg_min_tokens, migration=not args.no_migration,
        max_migrations=args.max_migrations, address=args.cluster_address)


def threads_per_worker(num_workers: int) -> int | None:
    """Workers sharing this machine split its cores (None: one worker takes them all)."""
    return max(1, default_num_threads() // num_workers) if num_workers > 1 else None


# -- kiln worker ------------------------------------------------------------------------------

def register(sub: argparse._SubParsersAction) -> None:
    from kiln.serve.cli import engine_flags  # the engine flags are kiln serve's

    p = sub.add_parser("worker", help="an engine worker that joins a running gateway",
                       description="Load the model and serve a gateway's requests "
                                   "(kiln serve --cluster-address) from this machine.")
    p.add_argument("--gateway", required=True, help="the gateway's tcp://HOST:PORT")
    p.add_argument("--role", default="both", choices=["prefill", "decode", "both"])
    p.add_argument("--worker-id", default=None, help="unique name (default: host-pid)")
    p.add_argument("--transfer-host", default="0.0.0.0",
                   help="interface the KV transfer socket binds (default all)")
    p.add_argument("--advertise-host", default=None,
                   help="address other workers dial for KV transfers (default: the address "
                        "this machine reaches the gateway from)")
    engine_flags(p.add_argument_group("engine"))
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
    from kiln.serve.cli import engine_config

    if not args.gateway.startswith("tcp://"):
        raise ValueError(f"--gateway must be tcp://HOST:PORT, got {args.gateway!r}")
    return WorkerConfig(
        engine=engine_config(args, args.threads), gateway_address=args.gateway,
        worker_id=args.worker_id or default_worker_id(), role=args.role,
        heartbeat_interval_s=args.heartbeat_interval, transfer_host=args.transfer_host,
        advertise_host=args.advertise_host or local_address_towards(args.gateway))


def run(args: argparse.Namespace) -> int:
    from kiln.cluster.worker import Worker, run_worker

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
