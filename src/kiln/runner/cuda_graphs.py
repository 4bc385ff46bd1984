"""CUDA graphs for decode steps: one graph per bucketed batch size, captured at start and
replayed with the step's inputs copied into static buffers.

A decode step (every sequence computes one token: no prefill chunk, no draft tokens) of n
sequences runs as the graph of the smallest bucket B >= n. The first n rows of the static
buffers take the step's token ids, positions, cache slots, context lengths and block tables;
the B - n padding rows compute token 0 at position 0 of a scratch block that the block pool
never hands out (the runner allocates it beyond the pool), so they write and read only that
block, and their outputs are dropped. Any other step, or a batch larger than the largest
bucket, runs eagerly.

The bucket choice and the buffer filling are plain torch on any device (`capture_sizes`,
`bucket_for`, `is_decode_step`, `DecodeBuffers.load`: tested on the CPU, where
`DecodeGraphs(capture=False)` runs the padded step eagerly, with the metadata a graph would
have captured); capturing and replaying need a GPU. The backend builds the graph's metadata once per bucket from views of the static
buffers (`GraphBackend.graph_metadata`): nothing in it may read a tensor's value on the host,
and its kernels' launch shapes may depend only on the bucket and the longest possible
sequence.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from kiln.engine.contract import SchedulerOutput
from kiln.models.layers.attention import AttentionMetadata, SeqLayout
from kiln.runner.batch import BatchInputs

log = logging.getLogger(__name__)

# the model's forward over the static buffers: (input_ids, positions, meta) -> hidden [B, H]
ModelStep = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


@runtime_checkable
class GraphBackend(Protocol):
    """An attention backend whose decode steps can be captured in a CUDA graph."""

    def graph_metadata(self, layout: SeqLayout, seq_lens: torch.Tensor,
                       slot_mapping: torch.Tensor, block_size: int,
                       max_seq_len: int) -> AttentionMetadata:
        """Metadata for a decode step over `layout` (views of static buffers, one query token
        per sequence, `seq_lens` = context_lens + 1 among them) that reads them only on the
        device, so a replay sees their current values; launch shapes fixed by the layout's
        size and `max_seq_len`."""
        ...


def capture_sizes(max_num_seqs: int, largest: int = 256) -> tuple[int, ...]:
    """Bucketed batch sizes: 1, 2, 4, then every multiple of 8, up to max_num_seqs (capped
    at `largest`), which is always a bucket itself."""
    top = min(max_num_seqs, largest)
    sizes = [s for s in (1, 2, 4, *range(8, top + 1, 8)) if s <= top]
    if sizes[-1] != top:
        sizes.append(top)
    return tuple(sizes)


def bucket_for(num_seqs: int, sizes: Sequence[int]) -> int | None:
    """The smallest bucket that holds num_seqs sequences; None above the largest (eager)."""
    return next((size for size in sizes if size >= num_seqs), None) if num_seqs else None


def is_decode_step(sched: SchedulerOutput) -> bool:
    """Every scheduled sequence computes exactly one token (its last sampled one)."""
    return bool(sched.scheduled) and all(len(item.token_ids) == 1 for item in sched.scheduled)


class DecodeBuffers:
    """Static inputs of the largest bucket; a bucket of size B uses their first B rows."""

    def __init__(self, size: int, max_blocks: int, device: torch.device):
        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.int64, device=device)

        self.input_ids, self.positions, self.slot_mapping = zeros(size), zeros(size), zeros(size)
        self.context_lens, self.seq_lens = zeros(size), zeros(size)
        self.block_table = zeros(size, max_blocks)
        self.query_start = torch.arange(size, device=device)
        self.query_lens = torch.ones(size, dtype=torch.int64, device=device)

    def layout(self, size: int) -> SeqLayout:
        return SeqLayout(self.query_start[:size], self.query_lens[:size],
                         self.context_lens[:size], self.block_table[:size])

    def load(self, batch: BatchInputs, slot_mapping: torch.Tensor, size: int,
             scratch_block: int, block_size: int) -> None:
        """The step's n sequences into rows [0, n), padding rows [n, size) on the scratch
        block (block table columns past a row's blocks keep stale ids: never read)."""
        n, width = len(batch.input_ids), batch.layout.block_table.shape[1]
        self.input_ids[:n].copy_(batch.input_ids)
        self.positions[:n].copy_(batch.positions)
        self.slot_mapping[:n].copy_(slot_mapping)
        self.context_lens[:n].copy_(batch.layout.context_lens)
        self.seq_lens[:n].copy_(batch.layout.context_lens).add_(1)
        self.block_table[:n, :width].copy_(batch.layout.block_table)
        self.pad(n, size, scratch_block, block_size)

    def pad(self, start: int, size: int, scratch_block: int, block_size: int) -> None:
        """Rows [start, size): token 0 at position 0 of the scratch block."""
        self.input_ids[start:size] = 0
        self.positions[start:size] = 0
        self.context_lens[start:size] = 0
        self.seq_lens[start:size] = 1
        self.slot_mapping[start:size] = scratch_block * block_size
        self.block_table[start:size, 0] = scratch_block


def run_buckets_eagerly(runner, max_num_seqs: int, max_model_len: int) -> None:
    """Test mode of a built engine's ModelRunner: its decode steps go through the buckets'
    padded buffers and graph metadata, run eagerly (no capture; the CPU too). Reallocates the
    KV cache (with the scratch block), so call it before the engine's first step. On a GPU
    this is the computation a replay repeats: the tokens must be the graphs' bit for bit."""
    runner.use_graphs = True
    runner.allocate_kv_cache(runner.pool_blocks)
    runner.capture_graphs(max_num_seqs, max_model_len, capture=False)


@dataclass
class CapturedStep:
    graph: torch.cuda.CUDAGraph | None  # None: DecodeGraphs(capture=False) runs it eagerly
    meta: AttentionMetadata | None
    hidden: torch.Tensor | None  # the graph's output [B, H] (overwritten by each replay)


class DecodeGraphs:
    """Decode steps at bucketed batch sizes: `capture()` once (after the KV cache exists),
    then `bucket(sched)` says whether a step is served and `run` serves it."""

    def __init__(self, step: ModelStep, backend, sizes: Sequence[int], max_blocks: int,
                 scratch_block: int, block_size: int, device: torch.device, model: nn.Module,
                 capture: bool = True):
        if capture and not isinstance(backend, GraphBackend):
            raise ValueError(f"attention backend {type(backend).__name__} cannot be captured "
                             "in a CUDA graph (it has no graph_metadata)")
        self.step, self.backend, self.sizes = step, backend, tuple(sizes)
        self.scratch_block, self.block_size = scratch_block, block_size
        self.max_blocks, self.max_seq_len = max_blocks, max_blocks * block_size
        self.buffers = DecodeBuffers(self.sizes[-1], max_blocks, device)
        self.capture_graphs = capture
        self.steps: dict[int, CapturedStep] = {}
        self.served = 0  # steps run through a bucket (a figure for tests and logs)
        # a replay runs no module hooks (speculator feature taps, scoring): a step with any
        # runs eagerly. The dicts are edited in place when hooks come and go.
        self.hook_dicts = [d for m in model.modules()
                           for d in (m._forward_hooks, m._forward_pre_hooks)]

    def bucket(self, sched: SchedulerOutput, batch: BatchInputs) -> int | None:
        """The bucket that serves this step, or None (not a decode step, too many sequences,
        a block table wider than the buffers', or hooks to run)."""
        if (not self.steps or not is_decode_step(sched) or self._hooked()
                or batch.layout.block_table.shape[1] > self.max_blocks):
            return None
        return bucket_for(len(sched.scheduled), self.sizes)

    def _hooked(self) -> bool:
        return (any(self.hook_dicts) or bool(nn.modules.module._global_forward_hooks)
                or bool(nn.modules.module._global_forward_pre_hooks))

    def run(self, batch: BatchInputs, slot_mapping: torch.Tensor, size: int) -> torch.Tensor:
        """The step's hidden states [n, H] (its own copy), through bucket `size`."""
        self.buffers.load(batch, slot_mapping, size, self.scratch_block, self.block_size)
        self.served += 1
        captured = self.steps[size]
        if captured.graph is None:
            return self._eager(size, captured.meta)[:len(batch.input_ids)]
        captured.graph.replay()
        return captured.hidden[:len(batch.input_ids)].clone()

    def _eager(self, size: int, meta: AttentionMetadata | None) -> torch.Tensor:
        """The bucket's step without a graph: with the metadata a graph would have captured
        (built once over the buffers), or for a backend without one, built now."""
        b = self.buffers
        if meta is None:
            meta = self.backend.build_metadata(b.layout(size), b.positions[:size],
                                               self.block_size, b.slot_mapping[:size])
        return self.step(b.input_ids[:size], b.positions[:size], meta)

    def _graph_metadata(self, size: int) -> AttentionMetadata:
        b = self.buffers
        return self.backend.graph_metadata(b.layout(size), b.seq_lens[:size],
                                           b.slot_mapping[:size], self.block_size,
                                           self.max_seq_len)

    def capture(self) -> None:
        """One graph per bucket, largest first (the smaller ones reuse its memory pool).
        capture=False: none, each bucket's step runs eagerly over the same buffers and, where
        the backend has graph metadata, the same metadata a graph would replay (CPU tests)."""
        if not self.capture_graphs:
            graph_meta = isinstance(self.backend, GraphBackend)
            self.steps = {size: CapturedStep(None, self._graph_metadata(size) if graph_meta
                                             else None, None) for size in self.sizes}
            return
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            self.steps[size] = self._capture_one(size, pool)
        log.info("CUDA graphs captured for decode batches of %s sequences",
                 ", ".join(map(str, self.sizes)))

    def _capture_one(self, size: int, pool) -> CapturedStep:
        b = self.buffers
        b.pad(0, size, self.scratch_block, self.block_size)  # every row a padding row
        meta = self._graph_metadata(size)
        # warm up off the capture (Triton compiles on first launch) on a side stream
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self.step(b.input_ids[:size], b.positions[:size], meta)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            hidden = self.step(b.input_ids[:size], b.positions[:size], meta)
        return CapturedStep(graph, meta, hidden)
