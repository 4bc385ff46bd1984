"""Verification: which draft tokens the target accepts, and the one token it adds after them.

The runner hands over every sampling row of a step. A request with k drafts owns k + 1
consecutive rows: row j (0 <= j <= k) holds the target's logits after the verified tokens and
drafts x_1..x_j, so row j - 1 scores draft x_j and row k scores the token after all of them.
A request without drafts owns one row and is sampled exactly as without speculation.

Greedy rows: accept the longest prefix of drafts equal to the target's argmax, then emit the
argmax of the first row that disagrees (or of row k: the bonus token). The output is token for
token what decoding without drafts gives.

Sampled rows (standard speculative sampling, Leviathan et al. 2023, arXiv 2211.17192): with
p_j the distribution the sampler would draw from at row j - 1 (after penalties, masks,
temperature, top-k/p, min-p) and q_j the proposer's distribution for draft x_j, accept x_j with
probability min(1, p_j(x_j) / q_j(x_j)); at the first rejection emit a token drawn from the
normalized residual max(0, p_j - q_j) and stop; if every draft passes, draw the bonus from
p_{k+1}. Each emitted token is then distributed exactly as p, whatever q was. Proposers that
pick drafts deterministically (argmax, n-gram lookup) pass no q: q is one-hot at the draft, the
acceptance probability is p_j(x_j), and the residual is p_j without x_j.

Draft trees (`VerifyGroup.parents`): row 0 scores the children of the last known token and
row 1 + i those of draft i. Greedy: walk down from the root, at each node to the child equal
to the target's argmax of the node's row; emit the path's drafts and the argmax where no
child matches. Sampled (one-hot drafts only): at each node, try its children in order, each
with probability r(x) / sum(r), where r is the node's p with the children already rejected
zeroed (sampling from p by elimination: a token is emitted with probability exactly p(x)); an
accepted child continues the walk from its own row, and when every child is rejected the
token is drawn from r. The accepted path (`VerifyOutput.paths`) tells the runner whose KV to
keep.

Randomness: a seeded request draws its k uniforms and one more (for the final draw, through the
cumulative distribution as in the sampler) from its own generator, so its tokens depend only
on its seed and its drafts, never on its batch company.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.engine.contract import TokenLogprobs
from kiln.runner.sampler import (
    Sampler,
    SamplingRow,
    compute_logprobs,
    inverse_cdf_draw,
    row_argmax,
    take_rows,
)


@dataclass
class VerifyGroup:
    """One request's rows: `first_row` and the next len(drafts) rows of the step's logits."""

    first_row: int
    drafts: list[int]  # x_1..x_k; empty = a plain sampling row
    draft_probs: torch.Tensor | None = None  # [k, V] q_j, or None: drafts were one-hot
    parents: list[int] | None = None  # a tree: each draft's parent (-1 = root); None = chain


@dataclass
class VerifyOutput:
    token_ids: list[list[int]]  # per group: accepted drafts, then one token from the target
    logprobs: list[list[TokenLogprobs]] | None  # per group, when any row asks for logprobs
    paths: list[list[int] | None]  # per tree group: the accepted drafts' indices; else None


def verify(sampler: Sampler, logits: torch.Tensor, rows: list[SamplingRow],
           groups: list[VerifyGroup], bitmask: torch.Tensor | None = None) -> VerifyOutput:
    """logits: [R, V] float32 raw logits, one per entry of `rows`; groups partition the rows.
    `bitmask` (grammar masks, see Sampler) applies to draft rows too: a draft the grammar
    forbids gets p = 0 and is always rejected."""
    logits = logits[:, :sampler.vocab_size]
    processed = sampler.process(logits, rows, bitmask)
    tokens: list[list[int]] = [[] for _ in groups]
    paths: list[list[int] | None] = [None] * len(groups)
    plain = [i for i, g in enumerate(groups) if not g.drafts]
    if plain:
        index = [groups[i].first_row for i in plain]
        chosen = sampler.choose(take_rows(processed, index), [rows[r] for r in index]).tolist()
        for i, token in zip(plain, chosen, strict=True):
            tokens[i] = [token]
    drafted = [i for i, g in enumerate(groups) if g.drafts]
    greedy = [i for i in drafted if rows[groups[i].first_row].params.greedy]
    sampled = [i for i in drafted if not rows[groups[i].first_row].params.greedy]
    if greedy:
        _verify_greedy(processed, [groups[i] for i in greedy], tokens, paths, greedy)
    if sampled:
        _verify_sampled(sampler, processed, rows, [groups[i] for i in sampled], tokens, paths,
                        sampled)
    return VerifyOutput(tokens, _logprobs(logits, rows, groups, tokens, paths), paths)


def _group_rows(g: VerifyGroup) -> range:
    return range(g.first_row, g.first_row + len(g.drafts) + 1)


def _verify_greedy(processed: torch.Tensor, groups: list[VerifyGroup],
                   tokens: list[list[int]], paths: list[list[int] | None],
                   slots: list[int]) -> None:
    index = [r for g in groups for r in _group_rows(g)]
    argmax = row_argmax(processed[index]).tolist()
    at = 0
    for slot, g in zip(slots, groups, strict=True):
        target = argmax[at:at + len(g.drafts) + 1]
        at += len(target)
        if g.parents is None:
            tokens[slot] = accept_greedy(g.drafts, target)
        else:
            tokens[slot], paths[slot] = accept_greedy_tree(g.drafts, g.parents, target)


def accept_greedy(drafts: list[int], target: list[int]) -> list[int]:
    """Drafts while they equal the target's choices, then the target's next choice."""
    n = 0
    while n < len(drafts) and drafts[n] == target[n]:
        n += 1
    return drafts[:n] + [target[n]]


def children_of(parents: list[int]) -> dict[int, list[int]]:
    """node (-1 = root) -> its children's indices, in draft order."""
    children: dict[int, list[int]] = {}
    for i, parent in enumerate(parents):
        children.setdefault(parent, []).append(i)
    return children


def accept_greedy_tree(drafts: list[int], parents: list[int],
                       target: list[int]) -> tuple[list[int], list[int]]:
    """The tree walk: from the root (row 0), follow the child equal to the target's choice
    at the node's row (row 1 + i for draft i). Returns the emitted tokens and the path."""
    children, path, row = children_of(parents), [], 0
    node = -1
    while True:
        choice = target[row]
        step = next((c for c in children.get(node, ()) if drafts[c] == choice), None)
        if step is None:
            return [drafts[c] for c in path] + [choice], path
        path.append(step)
        node, row = step, 1 + step


def accept_sampled_tree(drafts: list[int], parents: list[int], p: torch.Tensor,
                        uniforms: torch.Tensor, final_u: torch.Tensor) -> tuple[list[int], list[int]]:
    """Sampling by elimination down a tree of one-hot drafts. p: [1 + n, V] target rows,
    uniforms: [n] (each child is tried at most once), final_u: U(0,1) for the final draw."""
    children, path, row, used = children_of(parents), [], 0, 0
    node = -1
    while True:
        residual = p[row].clone()
        step = None
        for c in children.get(node, ()):
            total = float(residual.sum())
            if total > 0 and float(uniforms[used]) * total < float(residual[drafts[c]]):
                step = c
                break
            used += 1
            residual[drafts[c]] = 0.0
        if step is None:
            final = residual if bool(residual.sum() > 0) else p[row]
            return [drafts[c] for c in path] + [_draw(final, final_u)], path
        used += 1
        path.append(step)
        node, row = step, 1 + step


def _verify_sampled(sampler: Sampler, processed: torch.Tensor, rows: list[SamplingRow],
                    groups: list[VerifyGroup], tokens: list[list[int]],
                    paths: list[list[int] | None], slots: list[int]) -> None:
    index = [r for g in groups for r in _group_rows(g)]
    probs = sampler.probabilities(processed[index], [rows[r] for r in index])
    at = 0
    for slot, g in zip(slots, groups, strict=True):
        k = len(g.drafts)
        p = probs[at:at + k + 1]
        at += k + 1
        uniforms, final_u = _randomness(sampler, rows[g.first_row], k)
        if g.parents is None:
            tokens[slot] = accept_sampled(g.drafts, p, g.draft_probs, uniforms, final_u)
        else:
            tokens[slot], paths[slot] = accept_sampled_tree(g.drafts, g.parents, p, uniforms,
                                                            final_u)


def accept_sampled(drafts: list[int], p: torch.Tensor, q: torch.Tensor | None,
                   uniforms: torch.Tensor, final_u: torch.Tensor) -> list[int]:
    """The rejection rule for one request. p: [k+1, V] target rows, q: [k, V] or None
    (one-hot drafts), uniforms: [k] U(0,1), final_u: U(0,1) for the one final draw."""
    x = torch.tensor(drafts, device=p.device)
    rows = torch.arange(len(drafts), device=p.device)
    p_x = p[rows, x]
    q_x = torch.ones_like(p_x) if q is None else q[rows, x].to(p.dtype)
    accepted = uniforms * q_x < p_x  # u < p/q, without dividing by a zero q
    n = len(drafts) if bool(accepted.all()) else int(accepted.to(torch.int8).argmin())
    if n == len(drafts):
        final = p[n]
    else:
        final = _residual(p[n], None if q is None else q[n].to(p.dtype), drafts[n])
    return drafts[:n] + [_draw(final, final_u)]


def _draw(weights: torch.Tensor, u: torch.Tensor) -> int:
    """One token from unnormalized weights [V] with the uniform u."""
    return int(inverse_cdf_draw(weights[None], u.reshape(1))[0])


def _residual(p: torch.Tensor, q: torch.Tensor | None, draft: int) -> torch.Tensor:
    """max(0, p - q) (unnormalized: the draw needs no normalization)."""
    if q is None:
        residual = p.clone()
        residual[draft] = 0.0
    else:
        residual = (p - q).clamp_(min=0.0)
    # a zero residual means p <= q everywhere, i.e. p == q: rejection was impossible, but
    # rounding can still get here; p itself is then the right distribution
    return residual if bool(residual.sum() > 0) else p


def _randomness(sampler: Sampler, row: SamplingRow, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """k uniforms for the drafts and one fp64 uniform for the final draw."""
    gen = row.generator if row.generator is not None else sampler.generator
    uniforms = torch.rand(k, generator=gen, device=gen.device)
    return uniforms, torch.rand((), dtype=torch.float64, generator=gen, device=gen.device)


def _logprobs(logits: torch.Tensor, rows: list[SamplingRow], groups: list[VerifyGroup],
              tokens: list[list[int]],
              paths: list[list[int] | None]) -> list[list[TokenLogprobs]] | None:
    """Raw-distribution logprobs of every emitted token, from the row that chose it."""
    want = max((r.params.logprobs for r in rows if r.params.logprobs is not None), default=None)
    if want is None:
        return None
    index = []
    for g, toks, path in zip(groups, tokens, paths, strict=True):
        offsets = range(len(toks)) if path is None else [0] + [1 + c for c in path]
        index.extend(g.first_row + j for j in offsets)
    flat = compute_logprobs(logits[index], torch.tensor([t for ts in tokens for t in ts],
                                                         device=logits.device), want)
    out, at = [], 0
    for toks in tokens:
        out.append(flat[at:at + len(toks)])
        at += len(toks)
    return out
