"""Starting the ranks of one engine on this machine and joining them into groups.

Rank 0 is the process that owns the engine (the offline `LLM`, or a cluster worker): it opens
a TCP store on 127.0.0.1 (the OS picks the port, so there is no race for a free one), starts
ranks 1..N-1 (N: T tensor-parallel ranks or P pipeline stages) as child processes (`python -m
MODULE`, a fresh interpreter: spawn, never fork, with the store's address in their arguments)
and every rank opens two gloo groups over the store: one for the model's collectives (between
pipeline stages: for the activations' point-to-point sends, kiln.distributed.pipe), bounded by
the configured timeout, and one for rank 0's step descriptions
(kiln.distributed.step_channel), unbounded since a rank idles there.

Threads: each rank runs `threads` intra-op threads (cores // ranks by default), set through
OMP_NUM_THREADS in a child's environment before torch starts. OpenMP's core binding is
removed from the children's environment: inherited as is, every rank would bind its threads
to the same first cores.

A following rank exits when rank 0's process is gone (`exit_with_parent`), whatever it was
doing: a rank outliving its engine would hold its cores and memory forever.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from kiln.distributed.communicator import (
    GlooCommunicator,
    ShmCommunicator,
    open_gloo_group,
    shm_available,
)
from kiln.distributed.pipe import StagePipe
from kiln.distributed.step_channel import IDLE_TIMEOUT_S, StepChannel

LOOPBACK = "127.0.0.1"
_BINDING_ENV = ("OMP_PROC_BIND", "OMP_PLACES", "GOMP_CPU_AFFINITY", "KMP_AFFINITY")


@dataclass(frozen=True)
class RankGroup:
    """One rank's view of its engine's ranks: the step channel, and either the model's
    collectives (tensor parallelism) or the links between stages (pipeline parallelism)."""

    comm: GlooCommunicator | None
    steps: StepChannel
    pipe: StagePipe | None = None

    @property
    def rank(self) -> int:
        return self.steps.rank

    def close(self) -> None:
        for part in (self.comm, self.pipe, self.steps):
            if part is not None:
                part.close()


def open_store(world_size: int, timeout_s: float, host: str = LOOPBACK,
               port: int = 0) -> dist.TCPStore:
    """Rank 0's rendezvous store at host:port (port 0: one the OS picks, read it back as
    `store.port`). ValueError naming the address where it cannot listen (a port in use)."""
    try:
        return dist.TCPStore(host, port, world_size, True, timedelta(seconds=timeout_s),
                             wait_for_workers=False)
    except (RuntimeError, OSError) as exc:
        raise ValueError(f"cannot open the ranks' rendezvous store at {host}:{port} "
                         f"(dist_init_addr): {str(exc).splitlines()[0][:200]}") from exc


def join_store(port: int, world_size: int, timeout_s: float,
               host: str = LOOPBACK) -> dist.TCPStore:
    """A client of rank 0's store (retries until it answers, for up to timeout_s)."""
    return dist.TCPStore(host, port, world_size, False, timedelta(seconds=timeout_s))


def node_address(store_host: str) -> str:
    """The address this node's ranks listen on for gloo and tell their peers: $KILN_HOST_IP
    if set (vLLM's VLLM_HOST_IP), else the local address this machine reaches the store's host
    from (its route's source; no packet is sent)."""
    if os.environ.get("KILN_HOST_IP"):
        return os.environ["KILN_HOST_IP"]
    family = socket.getaddrinfo(store_host, None)[0][0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((store_host, 9))
        return probe.getsockname()[0]


def join_groups(store: dist.Store, rank: int, world_size: int, timeout_s: float,
                all_reduce: str = "gloo", name: str = "", stages: int = 1,
                ranks_per_node: int | None = None, host: str | None = None) -> RankGroup:
    """This rank's groups; returns once every rank has joined (or raises after timeout_s).
    `all_reduce`: gloo, shm (shared memory; `name` unique among this machine's groups), or
    auto (shm where it runs); shared memory only for a model group whose ranks share a node
    (node n holds ranks [n L, (n + 1) L), L = `ranks_per_node`, all of them by default).
    `stages`: pipeline stages, each of world_size / stages tensor-parallel ranks: ranks
    [k T, (k + 1) T) form stage group k (k = 0: the last stage, kiln.distributed.pipe), with a
    model group of their own, and the ranks of one tensor-parallel index across the stages a
    pipe group. `host`: the address gloo listens on (kiln.distributed.communicator). Every
    rank must pass the same but `rank` and `host`."""
    tp_size = world_size // stages
    stage_group, tp_rank = divmod(rank, tp_size)
    on_one_node = (ranks_per_node or world_size) % tp_size == 0
    comm = pipe = None
    if tp_size > 1:
        model = open_gloo_group(store, f"model{stage_group}", tp_rank, tp_size, timeout_s,
                                host)
        if on_one_node and (all_reduce == "shm" or (all_reduce == "auto" and shm_available())):
            comm = ShmCommunicator(model, timeout_s,
                                   name if stages == 1 else f"{name}-{stage_group}")
        else:
            comm = GlooCommunicator(model, timeout_s)
    if stages > 1:
        pipe = StagePipe(open_gloo_group(store, f"pipe{tp_rank}", stage_group, stages,
                                         timeout_s, host), timeout_s)
    steps = open_gloo_group(store, "steps", rank, world_size, IDLE_TIMEOUT_S, host)
    return RankGroup(comm, StepChannel(steps), pipe)


def default_threads_per_rank(local_ranks: int) -> int:
    """This machine's cores split among the ranks it runs."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, cores // local_ranks)


def spawn_rank(module: str, args: list[str], threads: int) -> subprocess.Popen:
    """`python -m module *args` in a fresh interpreter with `threads` OpenMP threads."""
    env = {k: v for k, v in os.environ.items() if k not in _BINDING_ENV}
    env["OMP_NUM_THREADS"] = str(threads)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return subprocess.Popen([sys.executable, "-m", module, *args], env=env)


def torchrun_nodes(environ: Mapping[str, str]) -> dict[str, object]:
    """nnodes, node_rank and dist_init_addr from torchrun's environment (one kiln process per
    node, `torchrun --nproc-per-node 1`: kiln starts a node's ranks itself); {} outside
    torchrun or on one node. ValueError where torchrun started several processes per node."""
    if "MASTER_ADDR" not in environ or "WORLD_SIZE" not in environ:
        return {}
    per_node = int(environ.get("LOCAL_WORLD_SIZE", "1"))
    if per_node != 1:
        raise ValueError(f"torchrun started {per_node} processes per node (LOCAL_WORLD_SIZE): "
                         f"run one kiln process per node (--nproc-per-node 1), which starts "
                         f"the node's ranks")
    nnodes = int(environ["WORLD_SIZE"])
    if nnodes == 1:
        return {}
    node_rank = environ.get("NODE_RANK") or environ.get("GROUP_RANK") or environ.get("RANK", "0")
    return {"nnodes": nnodes, "node_rank": int(node_rank),
            "dist_init_addr": f"{environ['MASTER_ADDR']}:{environ.get('MASTER_PORT', '29500')}"}


def exit_with_parent(parent_pid: int, interval_s: float = 0.5) -> None:
    """A daemon thread that ends this process (exit status 1) once `parent_pid` is gone."""
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(interval_s)
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()
