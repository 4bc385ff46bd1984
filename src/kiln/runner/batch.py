"""The flat batch of one step: every scheduled token of every sequence, in one set of tensors.

Sequence i owns flat tokens [query_start[i], query_start[i] + query_len[i]). Besides token ids
and positions, the batch records which rows need logits: the positions that sample (the last
known token, plus one per draft token being verified) and, for requests asking for prompt
logprobs, every prompt position of the chunk.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.engine.scheduler import SchedulerOutput
from kiln.runner.attention import SeqLayout


@dataclass
class LogitsRows:
    """Rows of the logits matrix that belong to one scheduled request."""

    sample_start: int  # first of 1 + num_draft_tokens sampling rows (None-free: -1 unused)
    num_sample: int  # 0 when the step only prefills part of the prompt
    prompt_start: int  # first prompt-logprob row
    num_prompt: int  # rows predicting prompt tokens start_pos + 1 ...


@dataclass
class BatchInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    layout: SeqLayout
    logits_index: torch.Tensor  # [R] flat token index of each logits row
    rows: list[LogitsRows]  # per scheduled request


def build_batch(sched: SchedulerOutput) -> BatchInputs:
    token_ids: list[int] = []
    starts, lens, ctx, tables = [], [], [], []
    logits_index: list[int] = []
    rows: list[LogitsRows] = []
    for item in sched.scheduled:
        q_start, n = len(token_ids), len(item.token_ids)
        token_ids.extend(item.token_ids)
        starts.append(q_start)
        lens.append(n)
        ctx.append(item.start_pos)
        tables.append(item.block_ids)
        rows.append(_logits_rows(item, q_start, n, logits_index))
    width = max(len(t) for t in tables)
    layout = SeqLayout(
        query_start=torch.tensor(starts), query_lens=torch.tensor(lens),
        context_lens=torch.tensor(ctx),
        block_table=torch.tensor([t + [0] * (width - len(t)) for t in tables]))
    positions = _positions(layout, len(token_ids))
    return BatchInputs(torch.tensor(token_ids), positions, layout,
                       torch.tensor(logits_index, dtype=torch.int64), rows)


def _logits_rows(item, q_start: int, n: int, logits_index: list[int]) -> LogitsRows:
    prompt_start = len(logits_index)
    num_prompt = 0
    if item.prompt_logprobs:
        # row at position p predicts token p + 1; only prompt tokens count here
        num_prompt = max(0, min(item.start_pos + n, len(item.prompt_token_ids) - 1)
                         - item.start_pos)
        logits_index.extend(range(q_start, q_start + num_prompt))
    sample_start, num_sample = len(logits_index), 0
    if item.samples:
        num_sample = item.num_draft_tokens + 1
        logits_index.extend(range(q_start + n - num_sample, q_start + n))
    return LogitsRows(sample_start, num_sample, prompt_start, num_prompt)


def _positions(layout: SeqLayout, num_tokens: int) -> torch.Tensor:
    seq_of_token = torch.repeat_interleave(
        torch.arange(len(layout.query_lens)), layout.query_lens, output_size=num_tokens)
    return (torch.arange(num_tokens) - layout.query_start[seq_of_token]
            + layout.context_lens[seq_of_token])
