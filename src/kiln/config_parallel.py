"""Parallelism's settings (kiln.distributed, docs/parallelism.md, docs/moe.md): rank processes,
their collectives, machines, expert placement and data-parallel attention, checked together.
A leaf, as kiln.config is (which holds it in `EngineConfig` and re-exports it); split out of
it by concern.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from kiln.config_fields import check_choices, doc


@dataclass(frozen=True)
class ParallelConfig:
    num_threads: int | None = field(default=None, metadata=doc(
        "torch intra-op threads (of each rank)",
        none_means="all cores of this process; with ranks, cores // ranks each",
        flag="--threads"))
    # tensor parallelism (kiln.distributed, docs/parallelism.md): one engine over T rank
    # processes on this machine, each holding 1/T of every layer's weights and KV heads
    tensor_parallel_size: int = field(default=1, metadata=doc(
        "rank processes one engine's layers are split across (tensor parallelism, this "
        "machine, gloo)"))
    # pipeline parallelism (docs/parallelism.md): the decoder layers split into P contiguous
    # stages, one rank process each, activations passed stage to stage
    pipeline_parallel_size: int = field(default=1, metadata=doc(
        "rank processes one engine's layers are split across in contiguous stages (pipeline "
        "parallelism, this machine, gloo)"))
    pipeline_micro_batches: int | None = field(default=None, metadata=doc(
        "micro-batches each step is cut into, so the stages overlap within a step too (the "
        "engine already keeps one step per stage in flight)",
        none_means="1: the whole step"))
    all_reduce: Literal["auto", "gloo", "shm"] = field(default="auto", metadata=doc(
        "the ranks' all-reduce: shm (shared memory, this machine), gloo (TCP), or auto: shm "
        "where kiln's kernels build and it exists, else gloo"))
    dist_timeout_s: float = field(default=60.0, metadata=doc(
        "seconds a collective between ranks may wait before the engine fails (a dead rank "
        "fails it at once)"))
    # several machines (docs/parallelism.md "Across machines"): node R runs global ranks
    # R*L .. R*L+L-1 (L = world_size / nnodes); node 0 runs rank 0, the engine
    nnodes: int = field(default=1, metadata=doc(
        "machines (nodes) the ranks are spread over; every node is started with the same "
        "flags and its --node-rank"))
    node_rank: int = field(default=0, metadata=doc(
        "this node's index: 0 runs the engine (scheduler, rank 0), R > 0 only its ranks "
        "(`kiln worker --node-rank R ...`)"))
    dist_init_addr: str | None = field(default=None, metadata=doc(
        "HOST:PORT where the ranks meet (a TCP store on node 0; node 0's address as the "
        "other nodes reach it)", none_means="127.0.0.1 on a port the OS picks (one node)"))
    # mixture-of-experts models over the ranks (kiln.models.layers.expert_parallel,
    # docs/moe.md "Expert parallelism"): experts split by columns (default) or placed whole
    enable_expert_parallel: bool = field(default=False, metadata=doc(
        "place whole experts on the tensor-parallel (or data-parallel) ranks (expert "
        "parallelism) instead of splitting every expert's columns over them; attention stays "
        "tensor-parallel (or data-parallel)"))
    num_redundant_experts: int = field(default=0, metadata=doc(
        "with expert parallelism: extra copies of the hottest experts of each MoE layer, "
        "placed on the least-loaded ranks (their tokens split between the copies)"))
    expert_load_file: str | None = field(default=None, metadata=doc(
        "JSON of measured tokens per expert (LLM.expert_load().save) that expert placement "
        "and redundant copies follow", none_means="every expert equally loaded"))
    # data-parallel attention beside the experts (docs/moe.md "Data-parallel attention"): D
    # rank processes each run attention on its own requests, holding only their KV; the
    # mixture-of-experts blocks exchange the tokens and split the experts over the D ranks
    data_parallel_size: int = field(default=1, metadata=doc(
        "rank processes that each run attention whole on their own requests (their own KV "
        "cache, not duplicated), the mixture-of-experts layers' experts split over them "
        "(with --enable-expert-parallel: whole experts); MoE models on this machine"))
    # how data-parallel ranks trade tokens around a sparse block under expert parallelism
    # (docs/moe.md "All-to-all dispatch", kiln.distributed.expert_dispatch); vLLM's name
    all2all_backend: Literal["allgather_reducescatter", "alltoall"] = field(
        default="allgather_reducescatter", metadata=doc(
            "data-parallel expert exchange: allgather_reducescatter (every rank gathers every "
            "rank's tokens, runs its experts on all of them, and the partial sums are summed) "
            "or alltoall (each rank routes its own tokens and sends each (token, expert) row "
            "only to the rank holding that expert, which sends the output back); alltoall "
            "needs --data-parallel-size > 1 and --enable-expert-parallel"))

    def __post_init__(self):
        check_choices(self)
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got "
                             f"{self.tensor_parallel_size}")
        if self.dist_timeout_s <= 0:
            raise ValueError(f"dist_timeout_s must be > 0, got {self.dist_timeout_s}")
        if self.num_redundant_experts < 0:
            raise ValueError(f"num_redundant_experts must be >= 0, got "
                             f"{self.num_redundant_experts}")
        if self.num_redundant_experts and not self.enable_expert_parallel:
            raise ValueError(f"num_redundant_experts {self.num_redundant_experts} needs "
                             f"enable_expert_parallel (copies of whole experts on ranks)")
        self._check_pipeline()
        self._check_data_parallel()
        self._check_all2all()
        self._check_nodes()

    def _check_data_parallel(self) -> None:
        d = self.data_parallel_size
        if d < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {d}")
        if d == 1:
            return
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "nnodes"):
            if getattr(self, name) > 1:
                raise ValueError(f"data_parallel_size {d} with {name} {getattr(self, name)}: "
                                 f"data-parallel attention runs on one machine with whole "
                                 f"attention per rank; use one of them")

    def _check_all2all(self) -> None:
        if self.all2all_backend == "allgather_reducescatter":
            return
        if self.data_parallel_size < 2 or not self.enable_expert_parallel:
            raise ValueError(f"all2all_backend {self.all2all_backend!r} dispatches tokens "
                             f"between data-parallel ranks holding whole experts: it needs "
                             f"data_parallel_size > 1 and enable_expert_parallel (got "
                             f"data_parallel_size {self.data_parallel_size}, "
                             f"enable_expert_parallel {self.enable_expert_parallel})")

    def _check_nodes(self) -> None:
        n, r = self.nnodes, self.node_rank
        if n < 1:
            raise ValueError(f"nnodes must be >= 1, got {n}")
        if not 0 <= r < n:
            raise ValueError(f"node_rank {r} is out of range for nnodes {n} (0..{n - 1})")
        if self.world_size % n:
            raise ValueError(f"tensor_parallel_size {self.tensor_parallel_size} x "
                             f"pipeline_parallel_size {self.pipeline_parallel_size} = "
                             f"{self.world_size} ranks do not split evenly over nnodes {n}")
        if self.dist_init_addr is not None:
            split_host_port(self.dist_init_addr)
        elif n > 1:
            raise ValueError(f"nnodes {n} needs dist_init_addr HOST:PORT (node 0's address, "
                             f"where the ranks meet)")
        tp, per_node = self.tensor_parallel_size, self.ranks_per_node
        if self.all_reduce == "shm" and per_node % tp:
            raise ValueError(f"all_reduce shm needs each tensor-parallel group on one node: "
                             f"tensor_parallel_size {tp} does not divide the {per_node} "
                             f"ranks per node")

    @property
    def ranks_per_node(self) -> int:
        """Rank processes on each node (world_size / nnodes)."""
        return self.world_size // self.nnodes

    def _check_pipeline(self) -> None:
        p, m = self.pipeline_parallel_size, self.pipeline_micro_batches
        if p < 1:
            raise ValueError(f"pipeline_parallel_size must be >= 1, got {p}")
        if m is not None and m < 1:
            raise ValueError(f"pipeline_micro_batches must be >= 1, got {m}")

    @property
    def world_size(self) -> int:
        """Rank processes of one engine."""
        return self.tensor_parallel_size * self.pipeline_parallel_size * self.data_parallel_size


def split_host_port(address: str) -> tuple[str, int]:
    """`HOST:PORT` (`[v6]:PORT` for IPv6) as (host, port); ValueError naming it otherwise."""
    host, sep, port = address.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"dist_init_addr must be HOST:PORT with a port in 1..65535, got "
                         f"{address!r}")
    return host, int(port)
