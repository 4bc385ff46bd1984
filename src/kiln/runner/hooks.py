"""What the runner calls of the features that plug into its sampling step.

The runner knows none of them by name (a lower layer never imports a feature): the composition
root hands it the grammar masks (`ModelRunner.grammar_rows`, kiln.structured.bitmask's
`GrammarRows`), and a proposer with a draft vocabulary hands it a shortlist
(`ModelRunner.shortlist`, kiln.speculative.shortlist's `Shortlist`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from kiln.runner.sampler import Sampler, SamplingRow
from kiln.runner.verify import VerifyGroup


class StepGrammar(Protocol):
    """One step's grammar bitmask, for the whole batch at once. The runner calls `add` once
    per request that samples, in row order, then `fill` once; the object is not reused."""

    def add(self, grammar: object | None, first_row: int, drafts: list[int]) -> None:
        """Register a request's sampling rows first_row..first_row + len(drafts), if its
        grammar (the scheduler's `ScheduledRequest.grammar`; None: unconstrained) constrains
        them."""
        ...

    def fill(self, rows: list[SamplingRow]) -> torch.Tensor | None:
        """The step's packed bitmask (see `Sampler`), or None when no row is constrained; sets
        each constrained row's `bitmask_row`."""
        ...


StepGrammarFactory = Callable[[int], StepGrammar]  # vocabulary size -> an empty step's masks


class NoGrammar:
    """The runner's grammar masks until the composition root hands it real ones: a request
    with a grammar is an error (its output would silently ignore the grammar)."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def add(self, grammar: object | None, first_row: int, drafts: list[int]) -> None:
        if grammar is not None:
            raise RuntimeError("a request has a grammar, but the runner was given no grammar "
                               "masks (ModelRunner.grammar_rows)")

    def fill(self, rows: list[SamplingRow]) -> torch.Tensor | None:
        return None


class VerifyShortlist(Protocol):
    """Greedy verification that scores the whole vocabulary only on the rows its walk visits.
    It must emit token for token what `kiln.runner.verify.verify` would."""

    def applies(self, rows: list[SamplingRow], groups: list[VerifyGroup],
                prompt_logprobs_or_grammar: bool) -> bool:
        """Whether the step's sampling can take `verify` (greedy rows only, drafts in it)."""
        ...

    def verify(self, hidden: torch.Tensor, rows: list[SamplingRow], groups: list[VerifyGroup],
               sampler: Sampler, logits_of: Callable[[torch.Tensor], torch.Tensor]
               ) -> tuple[list[list[int]], list[list[int] | None]]:
        """From the sampling rows' final hidden states [R, H] (`logits_of`: the full LM head),
        each group's emitted tokens and, for a tree, its accepted path."""
        ...
