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
import subprocess
import sys
import threading
import time
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


def open_store(world_size: int, timeout_s: float) -> dist.TCPStore:
    """Rank 0's rendezvous store on a port the OS picks (read it back as `store.port`)."""
    return dist.TCPStore(LOOPBACK, 0, world_size, True, timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def join_store(port: int, world_size: int, timeout_s: float) -> dist.TCPStore:
    return dist.TCPStore(LOOPBACK, port, world_size, False, timedelta(seconds=timeout_s))


def join_groups(store: dist.Store, rank: int, world_size: int, timeout_s: float,
                all_reduce: str = "gloo", name: str = "", stages: int = 1) -> RankGroup:
    """This rank's groups; returns once every rank has joined (or raises after timeout_s).
    `all_reduce`: gloo, shm (shared memory; `name` unique among this machine's groups), or
    auto (shm where it runs). `stages`: pipeline stages, each of world_size / stages
    tensor-parallel ranks: ranks [k T, (k + 1) T) form stage group k (k = 0: the last stage,
    kiln.distributed.pipe), with a model group of their own, and the ranks of one
    tensor-parallel index across the stages a pipe group. Every rank must pass the same."""
    tp_size = world_size // stages
    stage_group, tp_rank = divmod(rank, tp_size)
    comm = pipe = None
    if tp_size > 1:
        model = open_gloo_group(store, f"model{stage_group}", tp_rank, tp_size, timeout_s)
        if all_reduce == "shm" or (all_reduce == "auto" and shm_available()):
            comm = ShmCommunicator(model, timeout_s,
                                   name if stages == 1 else f"{name}-{stage_group}")
        else:
            comm = GlooCommunicator(model, timeout_s)
    if stages > 1:
        pipe = StagePipe(open_gloo_group(store, f"pipe{tp_rank}", stage_group, stages,
                                         timeout_s), timeout_s)
    steps = open_gloo_group(store, "steps", rank, world_size, IDLE_TIMEOUT_S)
    return RankGroup(comm, StepChannel(steps), pipe)


def default_threads_per_rank(world_size: int) -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, cores // world_size)


def spawn_rank(module: str, args: list[str], threads: int) -> subprocess.Popen:
    """`python -m module *args` in a fresh interpreter with `threads` OpenMP threads."""
    env = {k: v for k, v in os.environ.items() if k not in _BINDING_ENV}
    env["OMP_NUM_THREADS"] = str(threads)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return subprocess.Popen([sys.executable, "-m", module, *args], env=env)


def exit_with_parent(parent_pid: int, interval_s: float = 0.5) -> None:
    """A daemon thread that ends this process (exit status 1) once `parent_pid` is gone."""
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(interval_s)
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()
