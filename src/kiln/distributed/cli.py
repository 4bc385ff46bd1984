"""A following rank of a tensor- or pipeline-parallel engine: `python -m kiln.distributed.cli
--launch-json`.

The process entry rank 0 starts (kiln.runner.rank_loop.Leader), not a user's command. It
registers kiln's plugins as the composition root does (the weight formats a checkpoint or
`quantization` names), joins rank 0's groups, builds its part of the model runner, and runs
rank 0's commands (kiln.runner.rank_loop) until told to stop. It exits when a collective fails (rank 0 died or
stopped answering) and when rank 0's process is gone, whatever it was doing.
"""

from __future__ import annotations

import argparse
import logging
import sys

import msgspec
import torch

from kiln.assembly import register_plugins
from kiln.distributed.communicator import RankFailure
from kiln.distributed.launch import RankGroup, exit_with_parent, join_groups, join_store
from kiln.runner.model_runner import ModelRunner
from kiln.runner.rank_loop import (
    AllocateKV,
    RankCommand,
    RankLaunch,
    RunStep,
    Stop,
    all_reduce_name,
    schedule_of,
    started_key,
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
            runner.follow_step(schedule_of(command), command.logits_index)
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
    store = join_store(launch.store_port, p.world_size, p.dist_timeout_s)
    store.set(started_key(launch.rank), "1")
    group = join_groups(store, launch.rank, p.world_size, p.dist_timeout_s,
                        p.all_reduce, all_reduce_name(launch.parent_pid, launch.store_port),
                        stages=p.pipeline_parallel_size)
    try:
        runner = ModelRunner(launch.model, launch.model_path, launch.cache, p, frozenset(),
                             ranks=group)
        follow(runner, group)
    except RankFailure as exc:
        log.warning("rank %d: %s; exiting", launch.rank, exc)
        return 1
    group.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
