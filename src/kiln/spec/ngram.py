"""N-gram (prompt lookup) proposer: if the last n tokens appeared before, guess what followed.

For n from `ngram_max` down to `ngram_min`, look for the latest earlier occurrence of the
sequence's last n tokens in its own prompt and output; the first n that matches proposes the
tokens that followed that occurrence (the latest one that is followed by k tokens). Longer
matches are more specific, recent ones more relevant (code and documents repeat their own
identifiers and phrases). Costs a few numpy
comparisons over the sequence per step; no model, no state.

With `tree_width` > 1 it proposes a tree: that chain first, then the continuations of other
earlier occurrences (the longest suffix's, latest first, then shorter suffixes'), merged by
common prefix, until the tree holds `tree_width` distinct continuations. Text that repeats
itself often repeats with variations (the same call with another argument, the same phrase
ending two ways): one of several continuations is right more often than the latest alone.
"""

from __future__ import annotations

import numpy as np

from kiln.config import DEFAULT_TREE_DRAFTS, SpeculativeConfig
from kiln.engine.scheduler import SchedulerOutput
from kiln.spec.proposer import Draft, DraftRequest, DraftTrie, ProposerContext, register_proposer


def propose_ngram(tokens: np.ndarray, k: int, n_min: int, n_max: int) -> list[int]:
    """Up to k tokens that followed an earlier occurrence of the longest matching suffix: the
    latest one followed by k tokens, else the earliest (whose continuation is longest)."""
    return ngram_match(tokens, k, n_min, n_max)[0]


def ngram_match(tokens: np.ndarray, k: int, n_min: int, n_max: int) -> tuple[list[int], int]:
    """`propose_ngram`'s drafts and the length of the suffix they matched (0: none)."""
    size = len(tokens)
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        suffix = tokens[size - n:]
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:size - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if len(hits):
            full = hits[hits + n + k <= size]  # occurrences followed by k known tokens
            start = int(full[-1] if len(full) else hits[0]) + n
            return tokens[start:start + k].tolist(), n
    return [], 0


MAX_OCCURRENCES = 64  # a tree looks at the latest this many occurrences of each suffix


def ngram_tree(tokens: np.ndarray, k: int, n_min: int, n_max: int, width: int,
               size: int = DEFAULT_TREE_DRAFTS) -> tuple[Draft, int]:
    """A tree of up to `width` distinct continuations (at most k deep, `size` drafts),
    `propose_ngram`'s chain first; and the length of the suffix that chain matched."""
    chain, matched = ngram_match(tokens, k, n_min, n_max)
    tree = DraftTrie(size)
    tree.add(chain)
    total = len(tokens)
    for n in range(min(n_max, total - 1, matched), n_min - 1, -1):
        if tree.leaves >= width or tree.full:
            break
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:total - 1], n)
        hits = np.flatnonzero((windows == tokens[total - n:]).all(axis=1))
        for start in hits[::-1][:MAX_OCCURRENCES].tolist():
            tree.add(tokens[start + n:start + n + k].tolist())
            if tree.leaves >= width or tree.full:
                break
    return tree.draft(), matched


@register_proposer("ngram")
class NgramProposer:
    def __init__(self, config: SpeculativeConfig, ctx: ProposerContext | None = None):
        self.n_min, self.n_max = config.ngram_min, config.ngram_max
        self.tree_size = config.tree_size

    def propose(self, sched: SchedulerOutput, wanted: list[DraftRequest]) -> list[Draft]:
        return [ngram_tree(np.asarray(w.request.all_token_ids), w.max_drafts, self.n_min,
                           self.n_max, w.tree_width, self.tree_size)[0] if w.tree_width > 1
                else Draft(propose_ngram(np.asarray(w.request.all_token_ids), w.max_drafts,
                                         self.n_min, self.n_max)) for w in wanted]

    def release(self, request_ids: list[str]) -> None:
        pass
