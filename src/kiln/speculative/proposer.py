"""The proposer interface: a speculator that guesses the next tokens of running requests.

Lifecycle, driven by `kiln.speculative.speculator.Speculator` once per engine step, after
`Scheduler.update` (so every request holds only verified tokens and no drafts):

  1. `propose(sched, wanted)`: `sched` is the step that just ran (what was computed, for
     proposers that follow the target's KV or hidden states: they must look at every
     scheduled request, including ones that just finished; each item's `prompt_token_ids`
     and `output_token_ids` now include the tokens this step verified); `wanted` lists the
     running requests that may get drafts now, each with at most how many. Returns one
     `Draft` per entry of `wanted` (empty = no guess). It must not mutate the requests: the
     speculator filters the drafts (grammar seam) and stores them on the request.
  2. `release(request_ids)`: those requests finished (in the step just proposed for, or
     earlier when aborted); drop their state. Called after `propose` in the same round.

Requests are read-only views: `all_token_ids` (verified tokens only), `params`,
`num_computed_tokens`. A proposer may keep per-request state keyed by `request_id`, and must
cope with a request it has never seen or one whose tokens it saw drafted and then rejected.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from kiln.config import CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig
    from kiln.config_speculative import SpeculativeConfig
    from kiln.engine.request import Request
    from kiln.engine.scheduler import SchedulerOutput
    from kiln.runner.model_runner import ModelRunner


@dataclass
class DraftRequest:
    """A running request that may get drafts this step."""

    request: Request
    max_drafts: int  # >= 1: the adaptive k, capped by max_tokens and max_model_len
    tree_width: int = 1  # > 1: a tree of up to this many continuations is welcome


@dataclass
class Draft:
    token_ids: list[int] = field(default_factory=list)
    probs: torch.Tensor | None = None  # [len(token_ids), V] q per draft; None = one-hot drafts
    # a tree: each draft's parent, -1 for the last known token, else an earlier draft's index
    # (siblings distinct, the first child of each node its most likely one); None = a chain
    parents: list[int] | None = None

    def limit(self, depth: int, size: int) -> Draft:
        """At most `depth` drafts deep and `size` drafts in all (a tree keeps its first
        `size` nodes within that depth, so every kept node's parent is kept). A tree that is
        left a chain becomes one."""
        if self.parents is None:
            n = min(depth, size)
            return Draft(self.token_ids[:n], None if self.probs is None else self.probs[:n])
        from kiln.engine.scheduler import tree_depths

        index, tokens, parents = {-1: -1}, [], []  # kept node -> its new index
        for i, (token, parent, d) in enumerate(zip(self.token_ids, self.parents,
                                                   tree_depths(self.parents), strict=True)):
            if d <= depth and len(tokens) < size and parent in index:
                index[i] = len(tokens)
                tokens.append(token)
                parents.append(index[parent])
        if all(p == i - 1 for i, p in enumerate(parents)):
            return Draft(tokens)
        return Draft(tokens, None, parents)

    def main_chain(self) -> Draft:
        """The chain of first children from the root (a tree's most likely path)."""
        if self.parents is None:
            return self
        chain, node = [], -1
        for i, parent in enumerate(self.parents):
            if parent == node:
                chain.append(self.token_ids[i])
                node = i
        return Draft(chain)


class DraftTrie:
    """Draft continuations (and trees) merged by common prefix, nodes in insertion order."""

    def __init__(self, size: int):
        self.size, self.tokens, self.parents = size, [], []
        self.children: dict[tuple[int, int], int] = {}  # (parent, token) -> node
        self.inner: set[int] = set()  # nodes with children (-1: the root)
        self.leaves = 0

    @property
    def full(self) -> bool:
        return len(self.tokens) >= self.size

    def add(self, continuation: list[int]) -> None:
        node = -1
        for token in continuation:
            node = self._child(node, token)
            if node is None:
                return

    def add_draft(self, draft: Draft) -> None:
        """Every path of a chain or tree (a tree's nodes in order, so parents come first)."""
        if draft.parents is None:
            self.add(draft.token_ids)
            return
        mine = {-1: -1}  # the draft's node -> the trie's
        for i, (token, parent) in enumerate(zip(draft.token_ids, draft.parents, strict=True)):
            if parent in mine and (child := self._child(mine[parent], token)) is not None:
                mine[i] = child

    def _child(self, node: int, token: int) -> int | None:
        """The child of `node` for `token`, added if new; None when new and the trie is full."""
        child = self.children.get((node, token))
        if child is None:
            if self.full:
                return None
            # a leaf's first child takes its place as a leaf; any other child is a new one
            self.leaves += int(node < 0 or node in self.inner)
            self.inner.add(node)
            child = self.children[(node, token)] = len(self.tokens)
            self.tokens.append(token)
            self.parents.append(node)
        return child

    def draft(self) -> Draft:
        return Draft(self.tokens, None, self.parents).limit(len(self.tokens), self.size)


@dataclass
class ProposerContext:
    """What a proposer may use of the engine it serves."""

    target: ModelRunner  # the target's runner: model, KV cache tensors, last hidden states
    model_path: str
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig
    max_model_len: int
    eos_token_ids: frozenset[int]


class Proposer(Protocol):
    """What the speculator calls (see the module docstring for the lifecycle)."""

    def propose(self, sched: SchedulerOutput, wanted: list[DraftRequest]) -> list[Draft]:
        """One `Draft` per entry of `wanted` (empty: no guess); mutates no request."""
        ...

    def release(self, request_ids: list[str]) -> None:
        """Drop the state of these ended requests."""
        ...


ProposerFactory = Callable[["SpeculativeConfig", ProposerContext], Proposer]
_PROPOSERS: dict[str, ProposerFactory] = {}  # SpeculativeConfig.method -> factory


def register_proposer(name: str) -> Callable[[ProposerFactory], ProposerFactory]:
    """Decorator: make a proposer (a class or factory taking (config, context)) buildable by
    `SpeculativeConfig.method`. The built-in ones register when their modules are imported
    (`kiln.speculative.register_builtin_proposers`); this module imports none of them."""
    def wrap(factory: ProposerFactory) -> ProposerFactory:
        _PROPOSERS[name] = factory
        return factory
    return wrap


def build_proposer(config: SpeculativeConfig, ctx: ProposerContext) -> Proposer:
    """The registered proposer `config.method` names (`config` resolved:
    `SpeculativeConfig.resolved`)."""
    factory = _PROPOSERS.get(config.method)
    if factory is None:
        raise ValueError(f"unknown speculative method {config.method!r}; known: "
                         f"{', '.join(sorted(_PROPOSERS))}")
    return factory(config, ctx)
