"""Pipeline parallelism's step: every stage runs its layers over the step's micro-batches.

Each rank holds one stage's contiguous decoder layers (kiln.models.layers.pipeline) and the
KV cache of those layers only. Rank 0 broadcasts the step (kiln.runner.rank_loop.RunStep) to
every stage, and each splits it the same way (`micro_batches`: contiguous runs of the flat
batch of about equal tokens, a long prefill chunk cut between them). Then, per micro-batch m
in order:

    first stage:  embed -> its layers -> send (x, residual) to the next stage
    other stages: receive (x, residual) -> its layers -> send on, or, on the last stage
                  (rank 0), the final norm: the hidden states of micro-batch m

so stage s works on micro-batch m while stage s + 1 works on m - 1: with M micro-batches
and P stages a step takes M + P - 1 slots of one micro-batch's stage time where one process
takes M x P. Every stage runs the micro-batches in the same order, so where a sequence's
query is cut, its later part reads the KV its earlier part wrote on that stage, and the KV
each stage writes and reads is what one process would. The last stage's hidden states,
concatenated in micro-batch order, are the whole step's flat batch; rank 0 computes the
logits and samples as one process does.

Steps overlap too: rank 0's engine keeps one step per stage in flight (kiln.engine.pipelined),
submitting a step (`StageRunner.post`: broadcast, receives posted) before it finishes the
previous one. Every rank begins the steps in broadcast order, so all count the same tags.
With tensor-parallel stages, the last stage's other ranks must run each step when rank 0
does (their all-reduces and the logits gather meet): they post a step when it is broadcast
and run the oldest posted (`run_oldest`) when rank 0 says it finishes one (a `RunStep` that
says so, or a `FinishStep`), so they keep the same steps in flight as rank 0.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections import deque
from dataclasses import dataclass

import torch

from kiln.config import ParallelConfig
from kiln.distributed.pipe import PendingReceive, StagePipe
from kiln.engine.contract import ScheduledRequest, SchedulerOutput
from kiln.models.layers.pipeline import PipelineStage, check_pipeline, split_layers, stage_of
from kiln.models.llama import LlamaArch
from kiln.models.loader import read_hf_config
from kiln.models.registry import resolve_architecture
from kiln.runner.batch import build_batch


def micro_batches(sched: SchedulerOutput, count: int) -> list[SchedulerOutput]:
    """The step's flat batch cut into at most `count` contiguous, non-empty micro-batches of
    about equal tokens; concatenated in order they are the step's flat batch. A sequence's
    query may be cut (a long prefill chunk spreads over several micro-batches: its later
    part attends to the KV of the earlier, which every stage has written by then), except
    one with draft tokens (a tree's attention bits span its whole query)."""
    total = sum(len(item.token_ids) for item in sched.scheduled)
    bounds = [total * k // count for k in range(1, count)]  # flat offsets where one ends
    groups: list[list[ScheduledRequest]] = [[] for _ in range(count)]
    start = 0
    for item in sched.scheduled:
        n = len(item.token_ids)
        cuts = [] if item.num_draft_tokens else [b - start for b in bounds if start < b < start + n]
        edges = [0, *cuts, n]
        for lo, hi in zip(edges, edges[1:], strict=False):
            groups[bisect.bisect_right(bounds, start + lo)].append(_query_part(item, lo, hi))
        start += n
    return [SchedulerOutput(g, sum(len(item.token_ids) for item in g)) for g in groups if g]


def _query_part(item: ScheduledRequest, lo: int, hi: int) -> ScheduledRequest:
    """Tokens [lo, hi) of a scheduled query, at their positions (only the last part samples)."""
    if lo == 0 and hi == len(item.token_ids):
        return item
    return dataclasses.replace(item, token_ids=item.token_ids[lo:hi],
                               start_pos=item.start_pos + lo,
                               samples=item.samples and hi == len(item.token_ids))


def num_micro_batches(parallel: ParallelConfig) -> int:
    return parallel.pipeline_micro_batches or 1


def check_stages(parallel: ParallelConfig, model_class: type, num_layers: int) -> None:
    """ValueError naming the numbers where the model cannot run in these stages."""
    size = parallel.pipeline_parallel_size
    if not hasattr(model_class, "holds_tensor"):
        raise ValueError(f"pipeline_parallel_size {size}: {model_class.__name__} cannot be "
                         f"split into stages yet; use 1")
    check_pipeline(size, num_layers)


def pipeline_stage(parallel: ParallelConfig, index: int, model_path: str) -> PipelineStage:
    """Stage `index` of the model at `model_path`."""
    size = parallel.pipeline_parallel_size
    _, arch = resolve_architecture(read_hf_config(model_path))
    return stage_of(index, size, arch.num_layers, head_cost(arch))


def kv_budget_layers(parallel: ParallelConfig, arch: LlamaArch) -> int:
    """Layers of the largest stage: the KV block count is sized for it, so that no rank
    holds more than the configured KV memory."""
    stages = split_layers(arch.num_layers, parallel.pipeline_parallel_size, head_cost(arch))
    return max(len(layers) for layers in stages)


def head_cost(arch: LlamaArch) -> float:
    """The LM head's multiply-adds per token, in dense decoder layers' (q, k, v and o, and
    the SwiGLU MLP; attention over the context not counted)."""
    h = arch.hidden_size
    layer = 2 * h * arch.head_dim * (arch.num_heads + arch.num_kv_heads) \
        + 3 * h * arch.intermediate_size
    return arch.vocab_size * h / layer


@dataclass
class StagePlan:
    """One step on this stage: its micro-batches, the tag of the first (each step's tags are
    its own, so steps in flight never mix), the receives posted for them (None on the
    first stage), and the flat rows whose logits a last-stage follower computes its share of
    (None: none)."""

    sched: SchedulerOutput
    parts: list[SchedulerOutput]
    first_tag: int
    received: list[PendingReceive] | None
    logits_index: list[int] | None = None


class StageRunner:
    """One rank's stage of every step (see the module docstring). Every rank begins the
    steps in the order rank 0 broadcasts them, so each counts the same tags."""

    def __init__(self, model: torch.nn.Module, backend, pipe: StagePipe, count: int,
                 block_size: int, device: torch.device, dtype: torch.dtype):
        self.model, self.backend, self.pipe = model, backend, pipe
        self.stage: PipelineStage = model.stage
        self.count, self.block_size = count, block_size
        self.device, self.dtype = device, dtype
        self.steps_begun = 0
        self.posted: deque[StagePlan] = deque()  # rank 0: steps submitted, not yet run

    def post(self, sched: SchedulerOutput, logits_index: list[int] | None = None) -> None:
        """Begin `sched` ahead of running it (rank 0, whose steps are in flight, and the last
        stage's other tensor-parallel ranks): its receives are posted now, so the stage
        before never waits to send it. `logits_index`: see `run_oldest`."""
        plan = self._begin(sched)
        plan.logits_index = logits_index
        self.posted.append(plan)

    def run_oldest(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """A last-stage rank other than rank 0: run the oldest posted step as rank 0 runs it
        (the all-reduces meet), then its share of the logits of the step's `logits_index`
        rows, gathered to rank 0."""
        plan = self.posted[0]
        hidden = self.run(plan.sched, kv_caches)
        if plan.logits_index is not None:
            self.model.compute_logits(hidden[torch.tensor(plan.logits_index, dtype=torch.int64)])

    def is_posted(self, sched: SchedulerOutput) -> bool:
        return any(plan.sched is sched for plan in self.posted)

    def run(self, sched: SchedulerOutput,
            kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor | None:
        """This stage's part of the step (KV written); the last stage returns the step's
        final hidden states [T, H], the others None once their sends have gone. Steps run
        in the order they were begun."""
        plan = self.posted.popleft() if self.posted else self._begin(sched)
        assert plan.sched is sched, "pipelined steps run in the order they were submitted"
        hidden = []
        for m, part in enumerate(plan.parts):
            batch = build_batch(part, self.device)
            meta = self.backend.build_metadata(batch.layout, batch.slot_positions,
                                               self.block_size)
            if plan.received is None:
                x, residual = self.model.embed(batch.input_ids), None
            else:
                x, residual = self.pipe.wait(plan.received[m]).to(self.device).unbind(0)
            x, residual = self.model.run_layers(x, residual, batch.positions, kv_caches, meta)
            if self.stage.is_last:
                hidden.append(self.model.final_norm(x, residual))
            else:  # (gloo sends from CPU memory)
                self.pipe.send_next(torch.stack((x, residual)).cpu(), plan.first_tag + m)
        self.pipe.flush()
        return torch.cat(hidden) if self.stage.is_last else None

    def _begin(self, sched: SchedulerOutput) -> StagePlan:
        parts = micro_batches(sched, self.count)
        first_tag = (self.steps_begun % _TAG_CYCLE) * self.count
        self.steps_begun += 1
        received = None if self.stage.is_first else self._post_receives(parts, first_tag)
        return StagePlan(sched, parts, first_tag, received)

    def _post_receives(self, parts: list[SchedulerOutput],
                       first_tag: int) -> list[PendingReceive]:
        """Every micro-batch's receive, posted before the first is waited on: [2, T_m, H]
        (x and the residual stream), in CPU memory (gloo's)."""
        hidden_size = self.model.arch.hidden_size
        return [self.pipe.post_receive(
            torch.empty(2, part.num_batched_tokens, hidden_size, dtype=self.dtype),
            first_tag + m) for m, part in enumerate(parts)]


_TAG_CYCLE = 1 << 20  # steps before tags repeat (far more than are ever in flight)
