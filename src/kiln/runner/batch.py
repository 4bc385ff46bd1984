"""The flat batch of one step: every scheduled token of every sequence, in one set of tensors.

Sequence i owns flat tokens [query_start[i], query_start[i] + query_len[i]). Besides token ids
and positions, the batch records which rows need logits: the positions that sample (the last
known token, plus one per draft token being verified) and, for requests asking for prompt
logprobs, every prompt position of the chunk.

Draft trees (kiln.speculative): a request whose drafts come with parents computes each draft in a
cache slot of its own (the slots after its last known token, in draft order) but at the
position of its depth in the tree, and attends only its own ancestors among the drafts
(`SeqLayout.tree_mask`). After verification the runner moves the accepted path's KV into
the slots of its positions (`ModelRunner._compact`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.config_speculative import MAX_TREE_DRAFTS
from kiln.engine.contract import SchedulerOutput, tree_depths
from kiln.models.layers.attention import SeqLayout


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
    positions: torch.Tensor  # [T] int64: rotary positions (a draft tree node's: its depth)
    slot_positions: torch.Tensor  # [T] int64: where each token's KV goes (= positions, but
    # for draft trees: node i of a tree rooted at position r sits at r + 1 + i)
    layout: SeqLayout
    logits_index: torch.Tensor  # [R] flat token index of each logits row
    rows: list[LogitsRows]  # per scheduled request
    slot_mapping: torch.Tensor | None = None  # [T] cache slots (build_batch's block_size)


def build_batch(sched: SchedulerOutput, device: torch.device,
                block_size: int | None = None) -> BatchInputs:
    """The step's flat batch, its tensors on `device`: the per-token and per-sequence integers
    built as Python lists and copied in one tensor (a batch-1 decode step's half-dozen small
    tensors and position arithmetic cost more than its attention), the block table in one more;
    each field a view of its slice. With `block_size`, also each token's cache slot
    (`slot_mapping`, as kiln.runner.slots.slot_mapping_for derives it)."""
    token_ids: list[int] = []
    positions: list[int] = []  # a token's position: its sequence's start + its offset
    starts, lens, ctx, tables = [], [], [], []
    logits_index: list[int] = []
    rows: list[LogitsRows] = []
    for item in sched.scheduled:
        q_start, n = len(token_ids), len(item.token_ids)
        token_ids.extend(item.token_ids)
        positions.extend(range(item.start_pos, item.start_pos + n))
        starts.append(q_start)
        lens.append(n)
        ctx.append(item.start_pos)
        tables.append(item.block_ids)
        rows.append(_logits_rows(item, q_start, n, logits_index))
    slots = [] if block_size is None else _slots(positions, lens, tables, block_size)
    fields = (token_ids, positions, starts, lens, ctx, logits_index, slots)
    flat = torch.tensor([v for f in fields for v in f], dtype=torch.int64, device=device)
    ids, slot_positions, query_start, query_lens, context_lens, logits_rows, slot_t = \
        flat.split([len(f) for f in fields])
    width = max(len(t) for t in tables)
    layout = SeqLayout(
        query_start=query_start, query_lens=query_lens, context_lens=context_lens,
        block_table=torch.tensor([t + [0] * (width - len(t)) for t in tables], device=device),
        max_query_len=max(lens))
    positions_t = slot_positions
    trees = [(start, item) for start, item in zip(starts, sched.scheduled, strict=True)
             if item.draft_parents is not None and item.num_draft_tokens]
    if trees:
        positions_t = slot_positions.clone()
        layout.tree_mask = torch.zeros(len(token_ids), dtype=torch.int64, device=device)
        for start, item in trees:
            _place_tree(item, start, positions_t, layout.tree_mask)
    return BatchInputs(ids, positions_t, slot_positions, layout, logits_rows, rows,
                       None if block_size is None else slot_t)


def _slots(positions: list[int], lens: list[int], tables: list[list[int]],
           block_size: int) -> list[int]:
    """Each token's cache slot: its sequence's block at position // block_size."""
    out: list[int] = []
    at = 0
    for n, table in zip(lens, tables, strict=True):
        out.extend(table[p // block_size] * block_size + p % block_size
                   for p in positions[at:at + n])
        at += n
    return out


MAX_TREE_QUERY = MAX_TREE_DRAFTS + 1  # a tree's query: its root (the last known token) + drafts


def _place_tree(item, q_start: int, positions: torch.Tensor, tree_mask: torch.Tensor) -> None:
    """Rotary positions by depth and attention bits of one request's draft tree: the query's
    known tokens (the last one is the root) are visible to every node, then each node sees
    its ancestors and itself."""
    n, d = len(item.token_ids), item.num_draft_tokens
    if n > MAX_TREE_QUERY:
        raise ValueError(f"a draft tree's query has {n} tokens; at most {MAX_TREE_QUERY}")
    root = n - 1 - d  # local index of the last known token
    parents = item.draft_parents[:d]
    known = (1 << (root + 1)) - 1
    bits: list[int] = []
    for i, parent in enumerate(parents):
        bits.append((known if parent < 0 else bits[parent]) | 1 << (root + 1 + i))
    at = q_start + root + 1
    positions[at:at + d] = item.start_pos + root + torch.tensor(tree_depths(parents),
                                                                device=positions.device)
    tree_mask[at:at + d] = torch.tensor(bits, device=tree_mask.device)


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
