"""Data-parallel attention beside the experts: one step over D ranks, each with its own requests.

With `data_parallel_size` D (docs/moe.md, "Data-parallel attention") the engine keeps one
scheduler on rank 0, which puts every request on one rank's KV pool
(kiln.engine.dp_kv: `ScheduledRequest.dp_rank`, its block ids in that rank's pool). Each step:

1. rank 0 splits the step by rank and broadcasts every rank's sequences and logits rows in one
   `DataParallelStep` (kiln.runner.rank_loop);
2. every rank runs the model on its own sequences: embedding, attention (whole heads, its own
   KV cache) and dense layers on its tokens only; around each sparse block the ranks trade
   tokens (kiln.distributed.dp_attention) and each computes its experts. A rank with no
   sequences this step runs only the sparse blocks, over no tokens of its own, so the
   collectives meet;
3. every rank runs the LM head on its own logits rows (the head is whole on every rank),
   padded to the step's widest rank and gathered to rank 0, which puts the rows back in the
   step's order (`logits_plan`) and samples as one process does.

Rank 0's sampler, grammars, seeded generators and prompt logprobs therefore see exactly the
rows a one-process engine computes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kiln.config import ParallelConfig
from kiln.distributed.communicator import Communicator
from kiln.distributed.dp_attention import TokenExchange
from kiln.engine.contract import SchedulerOutput
from kiln.models.layers.expert_parallel import ExpertParallelOptions
from kiln.models.layers.moe import SparseMoeBlock
from kiln.models.layers.parallel import TensorParallel
from kiln.runner.batch import BatchInputs, LogitsRows, build_batch
from kiln.runner.rank_loop import DataParallelStep, Leader, RunStep, schedule_of, step_seqs

_CPU = torch.device("cpu")


def attention_parallel(parallel: ParallelConfig,
                       comm: Communicator) -> tuple[TensorParallel, TokenExchange]:
    """The model's TensorParallel under data-parallel attention: no split (attention, dense
    layers, embedding and LM head whole on every rank), with the experts over the D ranks
    of `comm` and their tokens exchanged by the returned TokenExchange."""
    exchange = TokenExchange(comm, all_to_all=parallel.all2all_backend == "alltoall")
    options = dataclasses.replace(ExpertParallelOptions.from_parallel(parallel),
                                  data_parallel=exchange)
    return TensorParallel(None, options), exchange


def check_data_parallel(parallel: ParallelConfig, arch, check_experts: Callable) -> None:
    """ValueError naming the numbers where `arch` cannot run data-parallel attention over
    `parallel.data_parallel_size` ranks: a dense model, or experts that do not split.
    `check_experts`: kiln.models.layers.expert_parallel.check_expert_parallel."""
    size, moe = parallel.data_parallel_size, getattr(arch, "moe", None)
    if moe is None:
        raise ValueError(f"data_parallel_size {size} needs a mixture-of-experts model (the "
                         f"ranks share only the experts); this model is dense: run "
                         f"{size} engines instead")
    check_experts(moe, size, ExpertParallelOptions.from_parallel(parallel),
                  "data_parallel_size")


def split_by_rank(sched: SchedulerOutput, size: int) -> list[SchedulerOutput]:
    """Each rank's sequences of the step (`dp_rank`), in the step's order."""
    parts: list[list] = [[] for _ in range(size)]
    for item in sched.scheduled:
        parts[item.dp_rank].append(item)
    return [SchedulerOutput(p, sum(len(item.token_ids) for item in p)) for p in parts]


@dataclass(frozen=True)
class LogitsPlan:
    """Where each scheduled request's logits rows are in the ranks' gathered logits."""

    rows: list[LogitsRows]  # per scheduled request, rows of the assembled logits
    index: list[int]  # assembled row -> row of the stacked gather [D * width, V]


def logits_plan(sched: SchedulerOutput, rank_rows: list[list[LogitsRows]],
                width: int) -> LogitsPlan:
    """The step's logits rows in scheduled order, from each rank's own batch rows
    (`rank_rows[r]`: its requests in step order) gathered `width` rows per rank. A request's
    rows are contiguous on its rank: its prompt rows, then its sampling rows."""
    taken = [0] * len(rank_rows)
    rows, index = [], []
    for item in sched.scheduled:
        rank = item.dp_rank
        own = rank_rows[rank][taken[rank]]
        taken[rank] += 1
        rows.append(LogitsRows(len(index) + own.num_prompt, own.num_sample, len(index),
                               own.num_prompt))
        first = rank * width + own.prompt_start
        index.extend(range(first, first + own.num_prompt + own.num_sample))
    return LogitsPlan(rows, index)


class DataParallelAttention:
    """One rank's side of data-parallel attention's steps: rank 0 `lead`s, the others
    `follow` its DataParallelStep. `forward(batch)` runs the model on this rank's batch
    (attention metadata built by the runner) and returns its final hidden states."""

    def __init__(self, exchange: TokenExchange, model: torch.nn.Module,
                 forward: Callable[[BatchInputs], torch.Tensor], dtype: torch.dtype,
                 device: torch.device):
        self.exchange, self.model, self.forward = exchange, model, forward
        self.rank, self.size = exchange.rank, exchange.size
        self.dtype, self.device = dtype, device
        # every sparse block, in the order a forward runs them (an idle rank joins each)
        self.sparse_blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]

    def lead(self, sched: SchedulerOutput, leader: Leader) -> tuple[list[LogitsRows],
                                                                    torch.Tensor]:
        """Rank 0: run `sched` over the ranks; (each request's LogitsRows, the step's fp32
        logits [R, V] in scheduled order)."""
        parts = split_by_rank(sched, self.size)
        batches = [build_batch(p, self.device if r == self.rank else _CPU) if p.scheduled
                   else None for r, p in enumerate(parts)]
        index = [[] if b is None else b.logits_index.tolist() for b in batches]
        leader.send(DataParallelStep([step_seqs(p) for p in parts], index))
        gathered = self._run_own([p.num_batched_tokens for p in parts], batches[self.rank],
                                 index)
        width = max(len(i) for i in index)
        plan = logits_plan(sched, [[] if b is None else b.rows for b in batches], width)
        if not plan.index:
            return plan.rows, torch.empty(0, 0, device=self.device)
        stacked = torch.cat(gathered).to(self.device)
        return plan.rows, stacked[torch.tensor(plan.index, device=self.device)]

    def follow(self, step: DataParallelStep) -> None:
        """A following rank's share of rank 0's step."""
        own = schedule_of(RunStep(step.seqs[self.rank], None))
        batch = build_batch(own, self.device) if own.scheduled else None
        counts = [sum(len(s.token_ids) for s in seqs) for seqs in step.seqs]
        self._run_own(counts, batch, step.logits_index)

    def _run_own(self, counts: list[int], batch: BatchInputs | None,
                 logits_index: list[list[int]]) -> list[torch.Tensor] | None:
        """This rank's forward (or, with no sequences, its part in the sparse blocks) and
        its logits rows, padded to the widest rank's and gathered: rank 0 gets every
        rank's [width, V] (None elsewhere, and where no rank has logits rows)."""
        self.exchange.begin_step(counts)
        width = max(len(i) for i in logits_index)
        if batch is None:
            self._join_sparse_blocks()
            if not width:
                return None
            local = None
        else:
            hidden = self.forward(batch)
            if not width:
                return None
            # (this rank's rows as rank 0 listed them: a follower's batch knows no sampling)
            rows = torch.tensor(logits_index[self.rank], dtype=torch.int64, device=self.device)
            local = self.model.compute_logits(hidden[rows]).float()
        return self.exchange.comm.gather_to_first(self._padded(local, width))

    def _join_sparse_blocks(self) -> None:
        """A rank without sequences this step: every sparse block over no tokens of its own
        (it still computes its experts for the other ranks' tokens)."""
        hidden_size = self.sparse_blocks[0].gate.weight.shape[1]
        empty = torch.empty(0, hidden_size, dtype=self.dtype, device=self.device)
        for block in self.sparse_blocks:
            block(empty)

    def _padded(self, local: torch.Tensor | None, width: int) -> torch.Tensor:
        """`local` [n, V] with zero rows to [width, V] (gather needs one shape everywhere)."""
        vocab = self.model.arch.vocab_size
        padded = torch.zeros(width, vocab, dtype=torch.float32, device=self.device)
        if local is not None:
            padded[:local.shape[0]] = local
        return padded
