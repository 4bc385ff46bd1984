"""A step's sampling, between the model's logits and the runner's output: which logits rows
sample, with which parameters, history and generator (`StepSampling.plan`), the sampler and
draft verification over them (`StepSampling.sample`, kiln.runner.verify), and prompt
logprobs (`step_prompt_logprobs`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.engine.contract import ScheduledRequest, SchedulerOutput, TokenLogprobs
from kiln.runner.batch import LogitsRows
from kiln.runner.hooks import StepGrammar
from kiln.runner.sampler import (
    Sampler,
    SamplingRow,
    compute_logprobs,
    has_penalty,
    min_tokens_pending,
    row_argmax,
    take_rows,
)
from kiln.runner.verify import VerifyGroup, verify


@dataclass
class SamplePlan:
    """A step's sampling rows: one `SamplingRow` per row, its row of the logits
    (`index`), and per request that samples its `VerifyGroup` and scheduled position."""

    rows: list[SamplingRow]
    index: list[int]
    groups: list[VerifyGroup]
    owners: list[int]
    grammar_rows: StepGrammar


class StepSampling:
    """Plans and samples each step's rows. Holds the generator of each seeded request until
    `release` drops it."""

    def __init__(self, sampler: Sampler, device: torch.device):
        self.sampler, self.device = sampler, device
        self._generators: dict[str, torch.Generator] = {}

    def release(self, request_ids: list[str]) -> None:
        """Drop per-request state of finished requests."""
        for rid in request_ids:
            self._generators.pop(rid, None)

    def plan(self, scheduled: list[ScheduledRequest], rows: list[LogitsRows],
             grammar_rows: StepGrammar) -> SamplePlan:
        """The step's sampling rows: a request with drafts has 1 + k of them."""
        plan = SamplePlan([], [], [], [], grammar_rows)
        for i, (item, r) in enumerate(zip(scheduled, rows, strict=True)):
            if not r.num_sample:
                continue
            drafts = item.token_ids[len(item.token_ids) - item.num_draft_tokens:]
            parents = item.draft_parents if drafts else None
            plan.groups.append(VerifyGroup(len(plan.rows), drafts, item.draft_probs, parents))
            # kiln.structured: the step's bitmask (trees have no grammar)
            plan.grammar_rows.add(item.grammar, len(plan.rows), drafts)
            plan.owners.append(i)
            for j in range(r.num_sample):
                plan.rows.append(self._row(item, _draft_history(drafts, parents, j)))
                plan.index.append(r.sample_start + j)
        return plan

    def sample(self, scheduled: list[ScheduledRequest], plan: SamplePlan,
               logits: torch.Tensor):
        """Sample each request's row; a request with drafts has 1 + k rows, and
        kiln.runner.verify decides which drafts stand and adds one token after them."""
        result = [[] for _ in scheduled]
        paths: list[list[int] | None] = [None] * len(scheduled)
        want_logprobs = any(item.params.logprobs is not None for item in scheduled)
        lp_result = [[] for _ in scheduled] if want_logprobs else None
        if not plan.rows:
            return result, lp_result, paths
        out = verify(self.sampler, take_rows(logits, plan.index), plan.rows, plan.groups,
                     bitmask=plan.grammar_rows.fill(plan.rows))
        for g, owner in enumerate(plan.owners):
            result[owner] = out.token_ids[g]
            paths[owner] = out.paths[g]
            if lp_result is not None and scheduled[owner].params.logprobs is not None:
                lp_result[owner] = out.logprobs[g]
        return result, lp_result, paths

    def _row(self, item: ScheduledRequest, drafts_before: list[int]) -> SamplingRow:
        gen = None
        if item.params.seed is not None:
            gen = self._generators.get(item.request_id)
            if gen is None:
                gen = torch.Generator(self.device).manual_seed(item.params.seed)
                self._generators[item.request_id] = gen
        history = item.output_token_ids + drafts_before if drafts_before else item.output_token_ids
        return SamplingRow(item.params, item.prompt_token_ids, history, gen)


def plain_greedy(scheduled: list[ScheduledRequest]) -> bool:
    """Whether every request of the step takes its raw logits' argmax and nothing else: greedy,
    no drafts, no grammar, no penalties or pending min_tokens, no logprobs of any kind (a
    batch-1 decode step's usual case, whose sampling rows, plan and verification cost ~0.2 ms
    of a ~9 ms step)."""
    return all(item.num_draft_tokens == 0 and item.grammar is None and not item.prompt_logprobs
               and item.params.greedy and item.params.logprobs is None
               and not has_penalty(item.params)
               and not min_tokens_pending(item.params, item.output_token_ids)
               for item in scheduled)


def greedy_tokens(rows: list[LogitsRows], logits: torch.Tensor,
                  vocab_size: int) -> list[list[int]]:
    """Each request's one token for a `plain_greedy` step ([] where it does not sample): the
    argmax of its sampling row over the vocabulary, as `StepSampling.sample` gives it."""
    chosen = row_argmax(logits[:, :vocab_size]).tolist()
    return [[chosen[r.sample_start]] if r.num_sample else [] for r in rows]


def step_prompt_logprobs(sched: SchedulerOutput, rows: list[LogitsRows],
                         logits: torch.Tensor) -> list[list[TokenLogprobs] | None] | None:
    """Each request's prompt logprobs of this step's chunk; None when no request asks."""
    if not any(item.prompt_logprobs for item in sched.scheduled):
        return None
    return [_prompt_logprobs(item, r, logits)
            for item, r in zip(sched.scheduled, rows, strict=True)]


def _prompt_logprobs(item: ScheduledRequest, rows: LogitsRows,
                     logits: torch.Tensor) -> list[TokenLogprobs] | None:
    if not rows.num_prompt:
        return None
    lo = rows.prompt_start
    targets = torch.tensor(
        item.prompt_token_ids[item.start_pos + 1:item.start_pos + 1 + rows.num_prompt],
        device=logits.device)
    return compute_logprobs(logits[lo:lo + rows.num_prompt], targets,
                            item.params.prompt_logprobs or 0)


def _draft_history(drafts: list[int], parents: list[int] | None, row: int) -> list[int]:
    """The drafts before sampling row `row` (row 0: none): a chain's first `row`, a tree's
    path from the root to draft row - 1."""
    if parents is None or not row:
        return drafts[:row]
    path, node = [], row - 1
    while node >= 0:
        path.append(drafts[node])
        node = parents[node]
    return path[::-1]
