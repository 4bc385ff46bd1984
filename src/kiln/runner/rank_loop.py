"""The ranks of a tensor- or pipeline-parallel engine: rank 0 leads, the others follow its steps.

Rank 0 owns the scheduler (EngineCore) and the sampler; ranks 1..N-1 own only their part of
the model and of the KV cache (their heads, their pipeline stage's layers, or both). Whatever
rank 0's runner does to the model or the cache, it first tells the others in a `RankCommand` (a msgspec struct broadcast as bytes over the step
channel, kiln.distributed.step_channel; never pickled), and every rank then does the same:

  - `AllocateKV`: size the KV cache (rank 0 decides the block count).
  - `RunStep`: the step's sequences as the batch needs them (tokens, start position, block
    table, draft tree) and the hidden rows to compute logits of; every rank runs the forward
    (its all-reduces meet in the model) and its share of the LM head, gathered to rank 0.
    Pipeline stages run their layers over the step's micro-batches instead, passing
    activations on (kiln.runner.pipeline); rank 0, the last stage, computes the logits.
  - `FinishStep`: with tensor-parallel stages, the last stage's other ranks run the oldest
    step they began (rank 0 keeps steps in flight and runs each when it finishes it).
  - `DataParallelStep`: data-parallel attention: each rank's own sequences; every rank runs
    its own (an idle one only joins the sparse blocks' exchanges) and its LM head rows.
  - `MoveSlots`: move KV between slots (an accepted draft tree's path).
  - `Stop`: the engine is shutting down.

So speculative decoding (n-gram drafts are tokens of the step), structured output (a
bitmask on rank 0's logits) and prefix caching (block ids in the step) work unchanged.

A following rank's process is `python -m kiln.distributed.cli` (started by `Leader.start`).
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import subprocess
import time

import msgspec
import torch

from kiln.config import CacheConfig, ModelConfig, ParallelConfig
from kiln.config_parallel import split_host_port
from kiln.distributed.communicator import RankFailure, shm_available
from kiln.distributed.launch import (
    LOOPBACK,
    RankGroup,
    default_threads_per_rank,
    join_groups,
    node_address,
    open_store,
    spawn_rank,
)
from kiln.engine.contract import ScheduledRequest, SchedulerOutput
from kiln.sampling_params import SamplingParams

log = logging.getLogger(__name__)
STOP_WAIT_S = 10.0  # how long a stopping rank may take to exit before it is killed
# how long a rank's process may take to start (import torch, reach the rendezvous) on a
# loaded machine; one that dies meanwhile fails the start at once
START_TIMEOUT_S = 300.0


class StepSeq(msgspec.Struct, array_like=True):
    """One scheduled sequence, as far as the batch tensors need it."""

    token_ids: list[int]
    start_pos: int
    block_ids: list[int]
    num_draft_tokens: int
    draft_parents: list[int] | None


class AllocateKV(msgspec.Struct, tag=True, array_like=True):
    num_blocks: int


class RunStep(msgspec.Struct, tag=True, array_like=True):
    seqs: list[StepSeq]
    logits_index: list[int] | None  # flat rows to compute logits of; None: no LM head
    # tensor-parallel pipeline stages: the last stage's other ranks begin this step, then
    # (True) run the oldest one begun, as rank 0 does next (kiln.engine.pipelined)
    finish: bool = True


class FinishStep(msgspec.Struct, tag=True, array_like=True):
    """The last stage's other ranks run the oldest step begun (rank 0 is about to)."""


class DataParallelStep(msgspec.Struct, tag=True, array_like=True):
    """Data-parallel attention (kiln.runner.data_parallel): rank r runs `seqs[r]` (maybe
    none) and the LM head on its rows `logits_index[r]`, padded and gathered to rank 0."""

    seqs: list[list[StepSeq]]
    logits_index: list[list[int]]


class MoveSlots(msgspec.Struct, tag=True, array_like=True):
    src: list[int]
    dst: list[int]


class Stop(msgspec.Struct, tag=True, array_like=True):
    pass


RankCommand = AllocateKV | RunStep | FinishStep | MoveSlots | Stop
RankCommand = AllocateKV | RunStep | DataParallelStep | MoveSlots | Stop


class RankLaunch(msgspec.Struct):
    """What a following rank needs to build its part of the runner (its command line)."""

    model: ModelConfig
    model_path: str
    cache: CacheConfig
    parallel: ParallelConfig
    rank: int
    store_port: int
    parent_pid: int
    store_host: str = LOOPBACK
    gloo_host: str | None = None  # the address its gloo listens on (several nodes)


class NodeSpec(msgspec.Struct):
    """What node 0 publishes in the store (`ENGINE_KEY`) for the other nodes: its engine's
    settings, which every node's ranks must share (each node reads its own model path)."""

    model: ModelConfig
    cache: CacheConfig
    parallel: ParallelConfig  # all_reduce as given: each node resolves "auto" for itself


ENGINE_KEY = "kiln/engine"


def step_seqs(sched: SchedulerOutput) -> list[StepSeq]:
    return [StepSeq(item.token_ids, item.start_pos, item.block_ids, item.num_draft_tokens,
                    item.draft_parents if item.num_draft_tokens else None)
            for item in sched.scheduled]


_NO_PARAMS = SamplingParams()


def schedule_of(step: RunStep) -> SchedulerOutput:
    """A following rank's SchedulerOutput for `step`: what build_batch reads, no sampling."""
    scheduled = [ScheduledRequest("", s.token_ids, s.start_pos, s.num_draft_tokens,
                                  s.block_ids, False, _NO_PARAMS, [], [], False,
                                  draft_parents=s.draft_parents) for s in step.seqs]
    return SchedulerOutput(scheduled, sum(len(s.token_ids) for s in step.seqs))


class Leader:
    """Rank 0's handle on the other ranks: their processes, the groups, the command stream."""

    def __init__(self, group: RankGroup, processes: list[subprocess.Popen],
                 store: torch.distributed.Store, parallel: ParallelConfig):
        self.group, self.processes = group, processes
        self.store = store  # the rendezvous store lives as long as the groups
        self.parallel = parallel
        self.encoder = msgspec.msgpack.Encoder()
        self.closed = False
        atexit.register(self.close)

    @classmethod
    def start(cls, model: ModelConfig, model_path: str, cache: CacheConfig,
              parallel: ParallelConfig) -> Leader:
        """Start this node's ranks 1..L-1 and join them with every node's (returns once all
        are connected). Node 0 only: a node R > 0 runs its ranks with `run_node`."""
        if parallel.node_rank:
            raise ValueError(f"node_rank {parallel.node_rank} runs only its ranks: start it "
                             f"with `kiln worker --node-rank {parallel.node_rank} ...` (the "
                             f"engine, rank 0, runs on node 0)")
        size, timeout = parallel.world_size, parallel.dist_timeout_s
        pipeline = parallel.pipeline_parallel_size > 1
        threads = parallel.num_threads or default_threads_per_rank(parallel.ranks_per_node)
        published = NodeSpec(model, cache, parallel)
        parallel = with_resolved_all_reduce(parallel)
        host, port = (split_host_port(parallel.dist_init_addr) if parallel.dist_init_addr
                      else (LOOPBACK, 0))
        store = open_store(size, timeout, host, port)
        gloo_host = node_address(host) if parallel.nnodes > 1 else None
        store.set(ENGINE_KEY, msgspec.json.encode(published))
        processes = [spawn_follower(RankLaunch(model, str(model_path), cache, parallel, rank,
                                               store.port, os.getpid(), host, gloo_host),
                                    threads)
                     for rank in range(1, parallel.ranks_per_node)]
        try:
            wait_until_started(store, processes, parallel)
            group = join_groups(store, 0, size, timeout, parallel.all_reduce,
                                all_reduce_name(os.getpid(), store.port),
                                parallel.pipeline_parallel_size, parallel.ranks_per_node,
                                gloo_host)
        except (RuntimeError, RankFailure) as exc:
            codes = [p.poll() for p in processes]
            _kill(processes)
            raise RankFailure(f"{'pipeline' if pipeline else 'tensor'}-parallel ranks did not "
                              f"start (exit codes {codes}): {exc}") from exc
        log.info("tensor x pipeline parallel: %d x %d ranks over %d node(s), %d threads each, "
                 "%s, gloo over %s:%d", parallel.tensor_parallel_size,
                 parallel.pipeline_parallel_size, parallel.nnodes, threads,
                 f"all-reduce {parallel.all_reduce}" if parallel.tensor_parallel_size > 1
                 else "stage to stage", host, store.port)
        return cls(group, processes, store, parallel)

    def send(self, command: RankCommand) -> None:
        try:
            self.group.steps.send(self.encoder.encode(command))
        except RankFailure as exc:
            raise self.fail(exc) from exc

    def fail(self, failure: RankFailure) -> RankFailure:
        """After `failure`: abort, and return it with what the other nodes reported (which
        node and rank failed), to raise."""
        note = (nodes_report(self.store, self.processes, self.parallel)
                if self.parallel.nnodes > 1 and not self.closed else None)
        self.abort()
        return failure if note is None else RankFailure(f"{failure}; {note}")

    def abort(self) -> None:
        """After a failure: kill the other ranks and drop the groups."""
        if not self.closed:
            self.closed = True
            _kill(self.processes)
            self.group.close()

    def close(self) -> None:
        """Tell the other ranks to stop and wait for them (killed after STOP_WAIT_S)."""
        if self.closed:
            return
        try:
            self.send(Stop())
        except RankFailure:
            return
        self.closed = True
        for process in self.processes:
            try:
                process.wait(STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                process.kill()
        self.group.close()


def spawn_follower(launch: RankLaunch, threads: int) -> subprocess.Popen:
    return spawn_rank("kiln.distributed.cli",
                      ["--launch-json", msgspec.json.encode(launch).decode()], threads)


def started_key(rank: int) -> str:
    return f"started/{rank}"


def failed_key(node: int) -> str:
    """Where node `node`'s launcher (run_node) reports a rank of its that exited."""
    return f"failed/{node}"


def wait_until_started(store: torch.distributed.Store, processes: list[subprocess.Popen],
                       parallel: ParallelConfig, timeout_s: float = START_TIMEOUT_S) -> None:
    """Wait for ranks 1.. to reach the rendezvous (each sets its `started_key`): this node's
    (`processes`: ranks 1..L-1) fail it at once if one exits first and after `timeout_s` if
    one never comes; another node's after dist_timeout_s, or at once when it reports one of
    its ranks exited."""
    start = time.monotonic()
    keys = [started_key(rank) for rank in range(1, parallel.world_size)]
    while not store.check(keys):
        dead = [(rank, p.poll()) for rank, p in enumerate(processes, 1) if p.poll() is not None]
        if dead:
            raise RankFailure(f"rank {dead[0][0]} exited with status {dead[0][1]} while "
                              f"starting (see its log above)")
        if time.monotonic() - start > timeout_s:
            raise RankFailure(f"ranks did not start within {timeout_s:g} s")
        if parallel.nnodes > 1:
            check_nodes_joined(store, parallel, time.monotonic() - start)
        time.sleep(0.05)


def check_nodes_joined(store: torch.distributed.Store, parallel: ParallelConfig,
                       waited_s: float) -> None:
    """RankFailure naming the first node that reported a failure, or, past dist_timeout_s,
    the first whose ranks have not all joined."""
    per_node = parallel.ranks_per_node
    for node in range(1, parallel.nnodes):
        if store.check([failed_key(node)]):
            raise RankFailure(store.get(failed_key(node)).decode())
        ranks = range(node * per_node, (node + 1) * per_node)
        if waited_s > parallel.dist_timeout_s and not store.check(
                [started_key(r) for r in ranks]):
            raise RankFailure(
                f"node {node} (ranks {ranks[0]}..{ranks[-1]}) did not join within "
                f"{parallel.dist_timeout_s:g} s: start it with --nnodes {parallel.nnodes} "
                f"--node-rank {node} --dist-init-addr {parallel.dist_init_addr}")


def nodes_report(store: torch.distributed.Store, processes: list[subprocess.Popen],
                 parallel: ParallelConfig, wait_s: float = 2.0) -> str:
    """After a failure across nodes: which node's rank failed, as far as the nodes said
    (a node's launcher reports a rank that exited; a node that is gone reports nothing)."""
    local = [rank for rank, p in enumerate(processes, 1) if p.poll() not in (None, 0)]
    if local:
        return f"rank {local[0]} on node 0 exited"
    keys = [failed_key(node) for node in range(1, parallel.nnodes)]
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:  # a launcher sees its rank's exit a moment later
        reported = [key for key in keys if store.check([key])]
        if reported:
            return store.get(reported[0]).decode()
        time.sleep(0.1)
    return (f"node 0's ranks are alive and no other node reported a failure: a node of "
            f"1..{parallel.nnodes - 1} is gone or unreachable")


def with_resolved_all_reduce(parallel: ParallelConfig) -> ParallelConfig:
    """This node decides "auto" for its ranks: every rank of a group must sum the same way
    (the groups that span nodes use gloo whatever it says, kiln.distributed.launch)."""
    model_group = parallel.tensor_parallel_size * parallel.data_parallel_size
    if model_group == 1 or parallel.all_reduce != "auto":
        return parallel
    return dataclasses.replace(parallel, all_reduce="shm" if shm_available() else "gloo")


def all_reduce_name(leader_pid: int, port: int) -> str:
    """The shared-memory segment's name: unique among the machine's live engines."""
    return f"tp-{leader_pid}-{port}"


def _kill(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        if process.poll() is None:
            process.kill()
        process.wait()
