"""The grammar bitmask of one step, for the whole batch at once (the runner's
`kiln.runner.hooks.StepGrammar`; the composition root hands `GrammarRows` to the runner).

The runner registers each constrained request's sampling rows (`add`), then `fill` builds one
packed int32 bitmask in xgrammar's layout [rows, ceil(V / 32)] (bit j of word w allows token
32w + j; row i for sampling row i) and sets each constrained `SamplingRow.bitmask_row`; the
sampler applies it to the logits of every constrained row in one go (xgrammar's CPU kernel),
before penalties and temperature. Rows without drafts
are filled by xgrammar's batch matcher (native threads, no GIL); a request with k drafts owns
k + 1 rows, each filled after accepting the drafts before it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kiln.structured.constraint import TokenConstraint

if TYPE_CHECKING:
    from kiln.runner.sampler import SamplingRow


@dataclass
class _Entry:
    constraint: TokenConstraint
    first_row: int  # the request's first sampling row in the step
    drafts: list[int]


class GrammarRows:
    """Collects one step's constrained rows; `fill` returns the bitmask (or None)."""

    _batch_matcher = None  # one xgrammar BatchGrammarMatcher per process (its thread pool)

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.entries: list[_Entry] = []

    def add(self, grammar: TokenConstraint | None, first_row: int, drafts: list[int]) -> None:
        """Register a request's rows first_row..first_row + len(drafts) if it is constrained
        (`grammar`: the request's, which kiln.structured made)."""
        if grammar is not None and grammar.active:
            self.entries.append(_Entry(grammar, first_row, list(drafts)))

    def fill(self, rows: list[SamplingRow]) -> torch.Tensor | None:
        """The packed bitmask [len(rows), ceil(V / 32)]: a constrained row's mask sits at its
        own index (`bitmask_row` = the row), so the sampler applies it with xgrammar's kernel;
        unconstrained rows are all ones and never read."""
        if not self.entries:
            return None
        # on the host: xgrammar's matchers fill it there (the sampler moves it)
        shape = (len(rows), (self.vocab_size + 31) // 32)
        bitmask = torch.full(shape, -1, dtype=torch.int32, device="cpu")
        batched = []
        for e in self.entries:
            for j in range(len(e.drafts) + 1):
                rows[e.first_row + j].bitmask_row = e.first_row + j
            if e.drafts or e.constraint.matcher is None:
                e.constraint.fill_rows(bitmask, e.first_row, e.drafts)
            else:
                batched.append((e.constraint, e.first_row))
        if batched:
            self._fill_batched(bitmask, batched)
        return bitmask

    def _fill_batched(self, bitmask: torch.Tensor,
                      batched: list[tuple[TokenConstraint, int]]) -> None:
        if len(batched) == 1:
            constraint, row = batched[0]
            constraint.matcher.fill_next_token_bitmask(bitmask, row)
        else:
            matcher = _batch_matcher()
            matcher.batch_fill_next_token_bitmask([c.matcher for c, _ in batched], bitmask,
                                                  [row for _, row in batched])
        apply_utf8_rows(bitmask, batched)
        for constraint, row in batched:
            constraint.apply_ban(bitmask, row)
            constraint.apply_steer(bitmask, row)


def apply_utf8_rows(bitmask: torch.Tensor, rows: list[tuple[TokenConstraint, int]]) -> None:
    """`TokenConstraint.apply_utf8` for many rows in a few tensor operations (not a handful
    per row): each row ANDs in its UTF-8 state's mask, unless that would leave it none."""
    by_table: dict[int, list[tuple[TokenConstraint, int]]] = {}
    for constraint, row in rows:
        if constraint.utf8 is not None:
            by_table.setdefault(id(constraint.utf8), []).append((constraint, row))
    for group in by_table.values():
        table = group[0][0].utf8
        index = torch.tensor([row for _, row in group], dtype=torch.int64)
        states = torch.tensor([c.utf8_state for c, _ in group], dtype=torch.int64)
        masked = bitmask[index] & table.masks[states]
        keep = masked.any(dim=1)
        bitmask[index[keep]] = masked[keep]


def _batch_matcher():
    if GrammarRows._batch_matcher is None:
        import xgrammar as xgr
        GrammarRows._batch_matcher = xgr.BatchGrammarMatcher()
    return GrammarRows._batch_matcher
