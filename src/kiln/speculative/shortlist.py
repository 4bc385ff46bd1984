"""Greedy verification that scores the whole vocabulary only on the rows the walk visits.

A verify step computes the LM head for every draft it verifies, but greedy verification acts
on few of those rows: the root's, then each accepted draft's, accepted + 1 of a request's
1 + k. On a CPU the LM head is a fifth of the default model's weights (49,152 rows of 576),
and for a tree of 12 drafts it costs ~3 ms of a ~21 ms step, where 3 rows would cost ~1.8.

A shortlist of tokens (a speculator's draft vocabulary: the target's most frequent choices, 4,096
rows of the LM head) guesses every row's argmax cheaply, and the walk runs on those guesses.
The full LM head then scores the rows it visited, and the walk runs again on their exact
choices. Where an exact choice differs from the guess and leads to a draft whose row is not
scored yet (a lookup draft outside the shortlist, or rounding), the walk goes on with that row
still a guess, so its row is scored in the next round, and so on until the walk visits only
scored rows. Every choice the last walk acts on is then the argmax over the full vocabulary
after the sampler's processing, so its tokens are the plain path's, token for token; the
shortlist only decides how many rows get scored (one round in nearly every step).

Only greedy rows, with no logprobs, prompt logprobs or grammar in the step, take this path
(`shortlist_applies`); sampled rows need the whole distribution of every row they might visit.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kiln.runner.sampler import Sampler, SamplingRow
from kiln.runner.verify import VerifyGroup, accept_greedy, accept_greedy_tree

# Sampling rows in a step from which the shortlist pays. The LM head's cost hardly grows up to
# ~4 rows (its weights come from memory), and the shortlist's round costs about that of 3 to
# 4 rows of the LM head: the default model at batch 1 on two cores, after the step's forward,
# 3.2 ms without it and 2.9 with it at 9 rows, 4.2 and 3.4 at 13, 5.8 and 3.7 at 21, and no
# gain at 8 or fewer (see docs/decisions/0009).
SHORTLIST_MIN_ROWS = 9


@dataclass
class Shortlist:
    """Token ids [S] and the target's LM head rows for them (hidden [R, H] -> [R, S])."""

    ids: torch.Tensor
    lm: Callable[[torch.Tensor], torch.Tensor]  # a packed linear (kiln.speculative.head.model)

    def guess(self, hidden: torch.Tensor) -> list[int]:
        """Each row's likeliest token among the shortlist's."""
        return self.ids[self.lm(hidden).argmax(dim=-1)].tolist()

    # kiln.runner.hooks.VerifyShortlist: what the runner calls

    def applies(self, rows: list[SamplingRow], groups: list[VerifyGroup],
                prompt_logprobs_or_grammar: bool) -> bool:
        return shortlist_applies(rows, groups, prompt_logprobs_or_grammar)

    def verify(self, hidden: torch.Tensor, rows: list[SamplingRow], groups: list[VerifyGroup],
               sampler: Sampler, logits_of: Callable[[torch.Tensor], torch.Tensor]
               ) -> tuple[list[list[int]], list[list[int] | None]]:
        return verify_shortlisted(self, hidden, rows, groups, sampler, logits_of)


def shortlist_applies(rows: list[SamplingRow], groups: list[VerifyGroup],
                      prompt_logprobs_or_grammar: bool) -> bool:
    """Whether a step's sampling can take `verify_shortlisted`: enough rows, every one greedy,
    drafts in the step, no logprobs, and neither prompt logprobs nor a grammar anywhere in the
    step."""
    return (len(rows) >= SHORTLIST_MIN_ROWS and not prompt_logprobs_or_grammar
            and any(g.drafts for g in groups)
            and all(r.params.greedy and r.params.logprobs is None for r in rows))


def verify_shortlisted(shortlist: Shortlist, hidden: torch.Tensor, rows: list[SamplingRow],
                       groups: list[VerifyGroup], sampler: Sampler,
                       logits_of: Callable[[torch.Tensor], torch.Tensor]
                       ) -> tuple[list[list[int]], list[list[int] | None]]:
    """Greedy verification of `groups` (see kiln.runner.verify) from their sampling rows'
    final hidden states [R, H]; `logits_of(hidden rows)` is the target's full LM head.
    Returns each group's emitted tokens and, for trees, its accepted path."""
    guess = shortlist.guess(hidden)
    exact: dict[int, int] = {}
    while True:
        tokens, paths, visited = _walk(groups, lambda r: exact.get(r, guess[r]))
        missing = sorted(set(visited) - exact.keys())
        if not missing:
            return tokens, paths
        logits = logits_of(hidden[torch.tensor(missing, device=hidden.device)]).float()[:, :sampler.vocab_size]
        chosen = sampler.process(logits, [rows[r] for r in missing]).argmax(dim=-1)
        exact.update(zip(missing, chosen.tolist(), strict=True))


def _walk(groups: list[VerifyGroup], choice: Callable[[int], int]):
    """The greedy walk of every group on the row choices `choice(row)` gives; also the rows
    it read."""
    tokens, paths, visited = [], [], []
    for g in groups:
        target = [choice(g.first_row + j) for j in range(len(g.drafts) + 1)]
        if g.parents is None:
            emitted, path = accept_greedy(g.drafts, target), None
            read = range(len(emitted))
        else:
            emitted, path = accept_greedy_tree(g.drafts, g.parents, target)
            read = [0] + [1 + c for c in path]
        tokens.append(emitted)
        paths.append(path)
        visited.extend(g.first_row + j for j in read)
    return tokens, paths, visited
