"""The argmax a grammar mask would leave, without masking the whole vocabulary (the sampler's
greedy fast path, kiln.runner.sampler; the plain path is `apply_token_bitmask` then argmax).

`bitmask` is xgrammar's packed int32 layout [rows, ceil(V / 32)]: bit j of word w allows token
32w + j. For a greedy row only the argmax of the masked logits matters: the lowest id among the
allowed tokens of highest logit. Counted at batch 64 under a JSON schema (default model,
`benchmarks/structured_profile.py`), about half the rows have their raw argmax forbidden, and
almost all of those allow at most 64 tokens (a key the grammar forces, a separator): so
  1. a row whose raw argmax is allowed keeps it (`forbidden_argmax` finds the others);
  2. a row allowing tokens in at most SPARSE_WORDS words of its mask: its allowed ids are
     enumerated and their logits compared (`_sparse_argmax`);
  3. any other row: its top TOP_CANDIDATES tokens are checked against the mask (`_top_argmax`);
  4. what neither finds (no allowed token among the candidates, a tie at their edge, every
     allowed logit -inf) is left to the full mask.
Each step is exact: it returns what argmax over the masked row returns.
"""

from __future__ import annotations

import torch

SPARSE_WORDS = 64  # mask words with an allowed bit, at most, for the enumerating path
TOP_CANDIDATES = 16  # top tokens checked against the mask on the other rows


def forbidden_argmax(argmax: torch.Tensor, targets: list[tuple[int, int]],
                     bitmask: torch.Tensor) -> list[tuple[int, int]]:
    """The (logits row, bitmask row) pairs of `targets` whose row's `argmax` token the
    bitmask forbids (a token past the bitmask's width counts as forbidden)."""
    rows = torch.tensor([i for i, _ in targets], device=argmax.device)
    allowed = _allowed(bitmask, [b for _, b in targets], argmax[rows][:, None])[:, 0]
    return [t for t, ok in zip(targets, allowed.tolist(), strict=True) if not ok]


def allowed_argmax(logits: torch.Tensor, targets: list[tuple[int, int]], bitmask: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, list[tuple[int, int]]]:
    """For (logits row, bitmask row) pairs whose raw argmax is forbidden: (logits rows,
    their masked argmax tokens) where found cheaply, and the pairs left to the full mask."""
    masks = torch.tensor([b for _, b in targets], device=bitmask.device)
    words = bitmask[masks]
    sparse = ((words != 0).sum(dim=1) <= SPARSE_WORDS).tolist()
    rows, tokens, left = [], [], []
    for path, wanted in ((_sparse_argmax, True), (_top_argmax, False)):
        part = [i for i, s in enumerate(sparse) if s == wanted]
        if not part:
            continue
        pairs = [targets[i] for i in part]
        found = path(logits, pairs, bitmask, words[torch.tensor(part, device=words.device)])
        for pair, token in zip(pairs, found.tolist(), strict=True):
            if token < 0:
                left.append(pair)
            else:
                rows.append(pair[0])
                tokens.append(token)
    device = logits.device
    return (torch.tensor(rows, dtype=torch.int64, device=device),
            torch.tensor(tokens, dtype=torch.int64, device=device), left)


def _sparse_argmax(logits: torch.Tensor, pairs: list[tuple[int, int]], bitmask: torch.Tensor,
                   words: torch.Tensor) -> torch.Tensor:
    """[n] the lowest allowed id of highest logit per row, enumerating the allowed ids (-1:
    none allowed, or all of them -inf)."""
    n, vocab = len(pairs), logits.shape[1]
    row, word = words.nonzero(as_tuple=True)  # row-major: ascending ids within a row
    shifts = torch.arange(32, dtype=torch.int32, device=words.device)
    pair, bit = (((words[row, word][:, None] >> shifts) & 1) != 0).nonzero(as_tuple=True)
    ids = (word[pair] * 32 + bit).to(logits.device)
    owner = row[pair].to(logits.device)
    inside = ids < vocab
    ids, owner = ids[inside], owner[inside]
    logit_rows = torch.tensor([i for i, _ in pairs], device=logits.device)
    values = logits[logit_rows[owner], ids]
    best = torch.full((n,), float("-inf"), device=logits.device).scatter_reduce(
        0, owner, values, "amax")
    candidates = torch.where(values == best[owner], ids, vocab)
    token = torch.full((n,), vocab, dtype=torch.int64, device=logits.device).scatter_reduce(
        0, owner, candidates, "amin")
    return torch.where((token < vocab) & torch.isfinite(best), token, -1)


def _top_argmax(logits: torch.Tensor, pairs: list[tuple[int, int]], bitmask: torch.Tensor,
                words: torch.Tensor) -> torch.Tensor:
    """[n] the masked argmax per row if it is among the row's top TOP_CANDIDATES and no id
    past them could tie it; -1 otherwise."""
    rows = torch.tensor([i for i, _ in pairs], device=logits.device)
    values, tokens = logits[rows].topk(min(TOP_CANDIDATES, logits.shape[1]), dim=-1)
    allowed = _allowed(bitmask, [b for _, b in pairs], tokens).to(logits.device)
    first = allowed.to(torch.int8).argmax(dim=1, keepdim=True)  # the first allowed candidate
    best = values.gather(1, first)
    ties = allowed & (values == best)
    token = torch.where(ties, tokens, logits.shape[1]).min(dim=1).values
    ok = allowed.any(dim=1) & (best[:, 0] > values[:, -1]) & torch.isfinite(best[:, 0])
    return torch.where(ok, token, -1)


def _allowed(bitmask: torch.Tensor, mask_rows: list[int], tokens: torch.Tensor) -> torch.Tensor:
    """[n, k] whether mask row mask_rows[i] allows tokens[i, j] (ids past the mask: no)."""
    tokens = tokens.to(bitmask.device)
    width = bitmask.shape[1]
    words = (tokens // 32).clamp(max=width - 1)
    masks = torch.tensor(mask_rows, device=bitmask.device)[:, None]
    bits = (bitmask[masks, words] >> (tokens % 32).to(torch.int32)) & 1
    return (bits != 0) & (tokens // 32 < width)
