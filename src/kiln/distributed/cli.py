"""A following rank of a tensor- or pipeline-parallel engine: `python -m kiln.distributed.cli
--launch-json`; and `run_node`, the launcher of a node R > 0's ranks (`kiln worker --node-rank R`).

The process entry rank 0 starts (kiln.runner.rank_loop.Leader), not a user's command. It
registers kiln's plugins as the composition root does (the weight formats a checkpoint or
`quantization` names), joins rank 0's groups, builds its part of the model runner, and runs
rank 0's commands (kiln.runner.rank_loop) until told to stop. It exits when a collective fails (rank 0 died or
stopped answering) and when rank 0's process is gone, whatever it was doing.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import subprocess
import sys
import time

import msgspec
import torch
import torch.distributed as dist

from kiln.assembly import register_plugins
from kiln.config import ParallelConfig
from kiln.config_parallel import split_host_port
from kiln.distributed.communicator import RankFailure
from kiln.distributed.launch import (
    RankGroup,
    default_threads_per_rank,
    exit_with_parent,
    join_groups,
    join_store,
    node_address,
)
from kiln.runner.model_runner import ModelRunner
from kiln.runner.rank_loop import (
    ENGINE_KEY,
    STOP_WAIT_S,
    AllocateKV,
    DataParallelStep,
    FinishStep,
    NodeSpec,
    RankCommand,
    RankLaunch,
    RunStep,
    Stop,
    all_reduce_name,
    failed_key,
    schedule_of,
    spawn_follower,
    started_key,
    with_resolved_all_reduce,
)

log = logging.getLogger("kiln.rank")


def follow(runner: ModelRunner, group: RankGroup) -> None:
    """A following rank's loop: run rank 0's commands until it says Stop."""
    decoder = msgspec.msgpack.Decoder(RankCommand)
    while True:
        command = decoder.decode(group.steps.receive())
        if isinstance(command, Stop):
            return
        if isinstance(command, AllocateKV):
            runner.allocate_kv_cache(command.num_blocks)
        elif isinstance(command, RunStep):
            runner.follow_step(schedule_of(command), command.logits_index, command.finish)
        elif isinstance(command, FinishStep):
            runner.follow_finish()
        elif isinstance(command, DataParallelStep):
            runner.follow_data_parallel(command)
        else:
            runner.move_slots(torch.tensor(command.src), torch.tensor(command.dst))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kiln.distributed.cli")
    parser.add_argument("--launch-json", required=True, help="RankLaunch as JSON")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING,
                        format="%(asctime)s rank %(levelname)s %(message)s")
    launch = msgspec.json.decode(args.launch_json, type=RankLaunch)
    exit_with_parent(launch.parent_pid)
    register_plugins()
    p = launch.parallel
    store = join_store(launch.store_port, p.world_size, p.dist_timeout_s, launch.store_host)
    store.set(started_key(launch.rank), "1")
    group = join_groups(store, launch.rank, p.world_size, p.dist_timeout_s,
                        p.all_reduce, all_reduce_name(launch.parent_pid, launch.store_port),
                        p.pipeline_parallel_size, p.ranks_per_node, launch.gloo_host)
    try:
        runner = ModelRunner(launch.model, launch.model_path, launch.cache, p, frozenset(),
                             ranks=group)
        follow(runner, group)
    except RankFailure as exc:
        log.warning("rank %d: %s; exiting", launch.rank, exc)
        return 1
    group.close()
    return 0


def run_node(model_path: str, own: ParallelConfig) -> int:
    """Node R > 0 of an engine over several machines (`kiln worker --node-rank R`): start its
    ranks R L .. R L + L - 1 with node 0's engine settings (read from node 0's store) and this
    node's `model_path` and threads, and watch them. Exit status 0 once they all stopped
    cleanly (node 0 said Stop); 1 when one failed (reported in the store, and the others
    killed) or node 0's store stopped answering (node 0 is gone)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s node %(levelname)s %(message)s")
    host, port = split_host_port(own.dist_init_addr)
    try:
        store = join_store(port, own.world_size, own.dist_timeout_s, host)
        spec = msgspec.json.decode(store.get(ENGINE_KEY), type=NodeSpec)
    except RuntimeError as exc:  # the store's timeout passed
        raise ValueError(f"node {own.node_rank}: node 0 did not answer at {host}:{port} within "
                         f"{own.dist_timeout_s:g} s ({str(exc).splitlines()[0][:200]})") from exc
    parallel = node_parallel(spec.parallel, own)
    per_node, node = parallel.ranks_per_node, own.node_rank
    threads = own.num_threads or default_threads_per_rank(per_node)
    gloo_host = node_address(host)
    processes = {rank: spawn_follower(RankLaunch(spec.model, model_path, spec.cache, parallel,
                                                 rank, port, os.getpid(), host, gloo_host),
                                      threads)
                 for rank in range(node * per_node, (node + 1) * per_node)}
    log.info("node %d of %d: ranks %d..%d, %d threads each, gloo at %s, node 0 at %s:%d",
             node, parallel.nnodes, min(processes), max(processes), threads, gloo_host, host,
             port)
    return watch_node(store, processes, node)


def node_parallel(spec: ParallelConfig, own: ParallelConfig) -> ParallelConfig:
    """Node 0's parallel settings for this node's ranks; ValueError where this node was
    started with other sizes."""
    for name in ("tensor_parallel_size", "pipeline_parallel_size", "nnodes"):
        if getattr(spec, name) != getattr(own, name):
            raise ValueError(f"node {own.node_rank} was started with {name} "
                             f"{getattr(own, name)}, node 0 with {getattr(spec, name)}: start "
                             f"every node with the same flags")
    return with_resolved_all_reduce(dataclasses.replace(
        spec, node_rank=own.node_rank, num_threads=own.num_threads))


def watch_node(store: dist.Store, processes: dict[int, subprocess.Popen], node: int,
               poll_s: float = 0.2, store_every_s: float = 2.0) -> int:
    """Wait for this node's ranks; on a failure, report it in the store (node 0 names it)
    and kill the others. Node 0's store that stops answering ends the ranks too (they would
    otherwise wait for the next step forever when node 0's machine is gone)."""
    last_store_check = time.monotonic()
    while True:
        codes = {rank: p.poll() for rank, p in processes.items()}
        failed = [(rank, code) for rank, code in codes.items() if code not in (None, 0)]
        if failed:
            message = f"node {node}: rank {failed[0][0]} exited with status {failed[0][1]}"
            log.warning("%s; stopping the node's ranks", message)
            try:
                store.set(failed_key(node), message)
            except RuntimeError:
                pass  # node 0 is gone too
            return _end(processes, 1)
        if all(code == 0 for code in codes.values()):
            return 0
        if time.monotonic() - last_store_check > store_every_s:
            last_store_check = time.monotonic()
            try:
                store.check([ENGINE_KEY])
            except RuntimeError:
                log.warning("node %d: node 0's store stopped answering; stopping", node)
                return _end(processes, 1, grace_s=STOP_WAIT_S)
        time.sleep(poll_s)


def _end(processes: dict[int, subprocess.Popen], status: int, grace_s: float = 0.0) -> int:
    """Kill the ranks still running (after `grace_s` for them to stop on their own); 0 if
    every one had exited cleanly."""
    deadline = time.monotonic() + grace_s
    for process in processes.values():
        try:
            process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    return 0 if all(p.returncode == 0 for p in processes.values()) else status


if __name__ == "__main__":
    sys.exit(main())
