"""N-gram (prompt lookup) proposer: if the last n tokens appeared before, guess what followed.

For n from `ngram_max` down to `ngram_min`, look for the latest earlier occurrence of the
sequence's last n tokens in its own prompt and output; the first n that matches proposes the
tokens that followed that occurrence (the latest one that is followed by k tokens). Longer
matches are more specific, recent ones more relevant (code and documents repeat their own
identifiers and phrases). Each request keeps an index of where each of its tokens occurs
(`TokenIndex`), so a lookup costs a few comparisons per earlier occurrence of the last
token; no model.

With `tree_width` > 1 it proposes a tree: that chain first, then the continuations of other
earlier occurrences (the longest suffix's, latest first, then shorter suffixes'), merged by
common prefix, until the tree holds `tree_width` distinct continuations. Text that repeats
itself often repeats with variations (the same call with another argument, the same phrase
ending two ways): one of several continuations is right more often than the latest alone.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kiln.config_speculative import DEFAULT_TREE_DRAFTS, SpeculativeConfig
from kiln.engine.scheduler import SchedulerOutput
from kiln.speculative.proposer import (
    Draft,
    DraftRequest,
    DraftTrie,
    ProposerContext,
    register_proposer,
)


def propose_ngram(tokens: Sequence[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Up to k tokens that followed an earlier occurrence of the longest matching suffix: the
    latest one followed by k tokens, else the earliest (whose continuation is longest)."""
    return ngram_match(tokens, k, n_min, n_max)[0]


def ngram_match(tokens: Sequence[int], k: int, n_min: int, n_max: int) -> tuple[list[int], int]:
    """`propose_ngram`'s drafts and the length of the suffix they matched (0: none)."""
    return TokenIndex().update(tokens).match(k, n_min, n_max)


def ngram_tree(tokens: Sequence[int], k: int, n_min: int, n_max: int, width: int,
               size: int = DEFAULT_TREE_DRAFTS) -> tuple[Draft, int]:
    """A tree of up to `width` distinct continuations (at most k deep, `size` drafts),
    `propose_ngram`'s chain first; and the length of the suffix that chain matched."""
    return TokenIndex().update(tokens).tree(k, n_min, n_max, width, size)


MAX_OCCURRENCES = 64  # a tree looks at the latest this many occurrences of each suffix


class TokenIndex:
    """Where each token occurs in a sequence that only grows (a request's prompt and
    output), kept up to date a few tokens per step: a lookup reads the occurrences of the
    last token and extends each backwards while it matches the suffix. Lookup runs for
    every decoding sequence at every step where it may draft (`ngram_first` looks for a
    match before it chooses a source), after a model forward has evicted everything from
    the CPU's caches: numpy's window comparison per suffix length cost 120 us per sequence
    of 150 tokens there (a millisecond per step at batch 8, 4% of the step), this a few."""

    def __init__(self):
        self.tokens: list[int] = []
        self.where: dict[int, list[int]] = {}  # token -> its positions, ascending
        self._found: tuple[int, int, list[tuple[int, int]]] | None = None  # (length, n_max,
        # occurrences): a step asks twice (does lookup match? then its drafts, or its tree)

    def update(self, tokens: Sequence[int]) -> TokenIndex:
        """Index the tokens appended since the last update. A request's tokens only grow;
        a sequence shorter than the one indexed, or differing at its last indexed token,
        is indexed afresh (a cheap check, not a proof that it extends the old one)."""
        tokens = tokens.tolist() if hasattr(tokens, "tolist") else tokens
        seen = len(self.tokens)
        if len(tokens) < seen or (seen and tokens[seen - 1] != self.tokens[-1]):
            self.__init__()
            seen = 0
        where = self.where
        for i in range(seen, len(tokens)):
            token = tokens[i]
            if token in where:
                where[token].append(i)
            else:
                where[token] = [i]
        self.tokens.extend(tokens[seen:])
        return self

    def occurrences(self, n_max: int) -> list[tuple[int, int]]:
        """(end, n) for every earlier occurrence of the last token, ascending: the last n
        tokens (n <= n_max, as many as match) also end at `end`."""
        tokens = self.tokens
        size = len(tokens)
        if size < 2:
            return []
        if self._found is not None and self._found[:2] == (size, n_max):
            return self._found[2]
        top = min(n_max, size - 1)
        out = []
        for end in self.where[tokens[-1]][:-1]:
            n = 1
            while n < top and n <= end and tokens[end - n] == tokens[size - 1 - n]:
                n += 1
            out.append((end, n))
        self._found = (size, n_max, out)
        return out

    def match(self, k: int, n_min: int, n_max: int) -> tuple[list[int], int]:
        """See `ngram_match`."""
        found = self.occurrences(n_max)
        n = max((m for _, m in found), default=0)
        if n < n_min:
            return [], 0
        ends = [end for end, m in found if m >= n]
        full = [end for end in ends if end + 1 + k <= len(self.tokens)]
        end = full[-1] if full else ends[0]
        return self.tokens[end + 1:end + 1 + k], n

    def tree(self, k: int, n_min: int, n_max: int, width: int,
             size: int = DEFAULT_TREE_DRAFTS) -> tuple[Draft, int]:
        """See `ngram_tree`."""
        chain, matched = self.match(k, n_min, n_max)
        tree = DraftTrie(size)
        tree.add(chain)
        found = self.occurrences(n_max)
        for n in range(matched, n_min - 1, -1):
            if tree.leaves >= width or tree.full:
                break
            for end in [end for end, m in reversed(found) if m >= n][:MAX_OCCURRENCES]:
                tree.add(self.tokens[end + 1:end + 1 + k])
                if tree.leaves >= width or tree.full:
                    break
        return tree.draft(), matched


class RequestIndexes:
    """A `TokenIndex` per request, updated when read, dropped when the request leaves."""

    def __init__(self):
        self._indexes: dict[str, TokenIndex] = {}

    def of(self, request) -> TokenIndex:
        index = self._indexes.get(request.request_id)
        if index is None:
            index = self._indexes[request.request_id] = TokenIndex()
        return index.update(request.all_token_ids)

    def release(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            self._indexes.pop(rid, None)


@register_proposer("ngram")
class NgramProposer:
    def __init__(self, config: SpeculativeConfig, ctx: ProposerContext | None = None):
        self.n_min, self.n_max = config.ngram_min, config.ngram_max
        self.tree_size = config.tree_size  # resolved by the Speculator
        self.indexes = RequestIndexes()

    def propose(self, sched: SchedulerOutput, wanted: list[DraftRequest]) -> list[Draft]:
        self.indexes.release(sched.finished_ids)  # aborted ones too
        out = []
        for w in wanted:
            index = self.indexes.of(w.request)
            out.append(index.tree(w.max_drafts, self.n_min, self.n_max, w.tree_width,
                                  self.tree_size)[0] if w.tree_width > 1
                       else Draft(index.match(w.max_drafts, self.n_min, self.n_max)[0]))
        return out

    def release(self, request_ids: list[str]) -> None:
        self.indexes.release(request_ids)
