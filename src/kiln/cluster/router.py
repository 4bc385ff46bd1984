"""Routing: which worker gets a request. Plain policy classes over hand-buildable state.

Everything is counted in KV blocks, so cache hits and load compare in one unit (Dynamo's
idea): for a prompt of P full blocks, a worker holding its first C blocks, with Q prompt blocks
already queued for prefill and A KV blocks held by its running requests,

    cost = prefill_weight * max(P - C, 0) + Q + A

`kv-aware` takes the cheapest worker (ties: the one whose prefix cache holds the fewest blocks,
so cold prompts spread over the caches, then the first in the given order), or with a
temperature T > 0 samples worker i with probability proportional to exp(-(cost_i / max cost) / T)
to spread load. `least-load` ignores the cache (cost = Q + A); `round-robin` cycles. Overloaded
workers are left out unless every worker is overloaded.

`Router.explain` computes the scores and the worker a route would take without routing (no
counter advances, nothing is charged); `Router.route` routes and charges the load tracker.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kiln.cluster.kv_index import KVIndex
from kiln.engine.block_hash import BlockHash, hash_prompt_blocks

POLICIES = ("round-robin", "least-load", "kv-aware")


@dataclass(frozen=True)
class WorkerState:
    """One candidate as the router sees it."""

    worker_id: str
    cached_blocks: int = 0  # leading prompt blocks it holds (from the KV index)
    queued_prefill_blocks: int = 0  # prompt blocks routed to it and not yet prefilled
    active_blocks: int = 0  # KV blocks its open requests hold (the decode load)
    overloaded: bool = False
    cache_blocks: int = 0  # blocks its whole prefix cache holds (breaks cost ties)


@dataclass(frozen=True)
class WorkerScore:
    worker_id: str
    cached_blocks: int
    prefill_blocks: int  # prompt blocks it would compute: max(P - C, 0)
    queued_prefill_blocks: int
    active_blocks: int
    cost: float
    overloaded: bool
    probability: float  # of being chosen by this decision (1/0 for deterministic policies)


@dataclass(frozen=True)
class Decision:
    policy: str
    prompt_blocks: int
    chosen: str
    scores: tuple[WorkerScore, ...]

    def score(self, worker_id: str) -> WorkerScore:
        return next(s for s in self.scores if s.worker_id == worker_id)

    @property
    def hit_blocks(self) -> int:
        return self.score(self.chosen).cached_blocks


class Policy(Protocol):
    name: str

    def costs(self, prompt_blocks: int, workers: Sequence[WorkerState]) -> list[float]:
        """One cost per worker (lower is better); pure."""

    def preview(self, costs: list[float], eligible: list[int],
                workers: Sequence[WorkerState]) -> tuple[int, list[float]]:
        """The index a route would choose now and each eligible worker's probability; pure."""

    def choose(self, costs: list[float], eligible: list[int],
               workers: Sequence[WorkerState]) -> int:
        """Choose (may advance a counter or draw a random number)."""


def kv_cost(prompt_blocks: int, w: WorkerState, prefill_weight: float = 1.0) -> float:
    return prefill_weight * max(prompt_blocks - w.cached_blocks, 0) \
        + w.queued_prefill_blocks + w.active_blocks


def _argmin(costs: list[float], eligible: list[int], workers: Sequence[WorkerState]) -> int:
    return min(eligible, key=lambda i: (costs[i], workers[i].cache_blocks, i))


def _one_hot(chosen: int, eligible: list[int]) -> list[float]:
    return [1.0 if i == chosen else 0.0 for i in eligible]


class KVAware:
    name = "kv-aware"

    def __init__(self, prefill_weight: float = 1.0, temperature: float = 0.0, seed: int = 0):
        if prefill_weight < 0 or temperature < 0:
            raise ValueError("prefill_weight and temperature must be >= 0")
        self.prefill_weight, self.temperature = prefill_weight, temperature
        self.rng = random.Random(seed)

    def costs(self, prompt_blocks: int, workers: Sequence[WorkerState]) -> list[float]:
        return [kv_cost(prompt_blocks, w, self.prefill_weight) for w in workers]

    def probabilities(self, costs: list[float], eligible: list[int]) -> list[float]:
        """Softmax over -(cost / max cost) / T among eligible workers."""
        top = max(costs[i] for i in eligible) or 1.0
        logits = [-(costs[i] / top) / self.temperature for i in eligible]
        peak = max(logits)
        weights = [math.exp(x - peak) for x in logits]
        total = sum(weights)
        return [w / total for w in weights]

    def preview(self, costs: list[float], eligible: list[int],
                workers: Sequence[WorkerState]) -> tuple[int, list[float]]:
        best = _argmin(costs, eligible, workers)
        if self.temperature == 0:
            return best, _one_hot(best, eligible)
        return best, self.probabilities(costs, eligible)

    def choose(self, costs: list[float], eligible: list[int],
               workers: Sequence[WorkerState]) -> int:
        if self.temperature == 0:
            return _argmin(costs, eligible, workers)
        probs = self.probabilities(costs, eligible)
        return self.rng.choices(eligible, weights=probs)[0]


class LeastLoad:
    name = "least-load"

    def costs(self, prompt_blocks: int, workers: Sequence[WorkerState]) -> list[float]:
        return [float(w.queued_prefill_blocks + w.active_blocks) for w in workers]

    def preview(self, costs: list[float], eligible: list[int],
                workers: Sequence[WorkerState]) -> tuple[int, list[float]]:
        best = _argmin(costs, eligible, workers)
        return best, _one_hot(best, eligible)

    def choose(self, costs: list[float], eligible: list[int],
               workers: Sequence[WorkerState]) -> int:
        return _argmin(costs, eligible, workers)


class RoundRobin:
    name = "round-robin"

    def __init__(self):
        self.turn = 0

    def costs(self, prompt_blocks: int, workers: Sequence[WorkerState]) -> list[float]:
        return [0.0] * len(workers)

    def preview(self, costs: list[float], eligible: list[int],
                workers: Sequence[WorkerState]) -> tuple[int, list[float]]:
        chosen = eligible[self.turn % len(eligible)]
        return chosen, _one_hot(chosen, eligible)

    def choose(self, costs: list[float], eligible: list[int],
               workers: Sequence[WorkerState]) -> int:
        chosen = eligible[self.turn % len(eligible)]
        self.turn += 1
        return chosen


def make_policy(name: str, prefill_weight: float = 1.0, temperature: float = 0.0,
                seed: int = 0) -> Policy:
    if name == "kv-aware":
        return KVAware(prefill_weight, temperature, seed)
    if name == "least-load":
        return LeastLoad()
    if name == "round-robin":
        return RoundRobin()
    raise ValueError(f"router must be one of {', '.join(POLICIES)}, got {name!r}")


def decide(policy: Policy, prompt_blocks: int, workers: Sequence[WorkerState],
           commit: bool) -> Decision:
    """Score `workers` (non-empty) and pick one; `commit=False` only previews."""
    if not workers:
        raise ValueError("no worker to route to")
    costs = policy.costs(prompt_blocks, workers)
    eligible = [i for i, w in enumerate(workers) if not w.overloaded] or list(range(len(workers)))
    best, probs = policy.preview(costs, eligible, workers)
    chosen = policy.choose(costs, eligible, workers) if commit else best
    prob_of = dict(zip(eligible, probs, strict=True))
    scores = tuple(WorkerScore(w.worker_id, w.cached_blocks,
                               max(prompt_blocks - w.cached_blocks, 0), w.queued_prefill_blocks,
                               w.active_blocks, costs[i], w.overloaded, prob_of.get(i, 0.0))
                   for i, w in enumerate(workers))
    return Decision(policy.name, prompt_blocks, workers[chosen].worker_id, scores)


# -- load tracking ----------------------------------------------------------------------------

@dataclass
class _Charge:
    worker: str
    prefill_blocks: int  # still queued for prefill (0 once the first token came)
    tokens: int  # tokens it holds KV for: prompt + produced so far


@dataclass
class LoadTracker:
    """Per-worker load the gateway itself can count, updated the moment it routes: prompt
    blocks queued for prefill (charged until the request's first token) and KV blocks of
    open requests (prompt + produced tokens, rounded up to blocks)."""

    block_size: int
    _charges: dict[str, _Charge] = field(default_factory=dict)
    _queued: dict[str, int] = field(default_factory=dict)
    _active: dict[str, int] = field(default_factory=dict)
    _open: dict[str, int] = field(default_factory=dict)

    def _blocks(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def charge(self, request_id: str, worker: str, num_tokens: int, prefill_blocks: int) -> None:
        """Charge `worker` a request starting from `num_tokens` tokens (replaces any charge)."""
        self.release(request_id)
        c = _Charge(worker, prefill_blocks, num_tokens)
        self._charges[request_id] = c
        self._queued[worker] = self._queued.get(worker, 0) + prefill_blocks
        self._active[worker] = self._active.get(worker, 0) + self._blocks(c.tokens)
        self._open[worker] = self._open.get(worker, 0) + 1

    def progressed(self, request_id: str, new_tokens: int) -> None:
        """The request produced `new_tokens` more tokens (its prefill is done)."""
        c = self._charges.get(request_id)
        if c is None:
            return
        self._queued[c.worker] -= c.prefill_blocks
        c.prefill_blocks = 0
        before = self._blocks(c.tokens)
        c.tokens += new_tokens
        self._active[c.worker] += self._blocks(c.tokens) - before

    def release(self, request_id: str) -> None:
        c = self._charges.pop(request_id, None)
        if c is None:
            return
        self._queued[c.worker] -= c.prefill_blocks
        self._active[c.worker] -= self._blocks(c.tokens)
        self._open[c.worker] -= 1

    def forget_worker(self, worker: str) -> None:
        for rid in [r for r, c in self._charges.items() if c.worker == worker]:
            self.release(rid)

    def queued_prefill_blocks(self, worker: str) -> int:
        return self._queued.get(worker, 0)

    def active_blocks(self, worker: str) -> int:
        return self._active.get(worker, 0)

    def num_open(self, worker: str) -> int:
        return self._open.get(worker, 0)


# -- the router ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Candidate:
    """A worker that may take the request, with what the load tracker cannot know."""

    worker_id: str
    overloaded: bool = False


class Router:
    """A policy over the KV index and the load tracker. Pure apart from the policy's own
    counter / RNG and the tracker's charges; no I/O."""

    def __init__(self, policy: Policy, index: KVIndex, loads: LoadTracker):
        self.policy, self.index, self.loads = policy, index, loads

    @property
    def block_size(self) -> int:
        return self.loads.block_size

    def hashes(self, prompt_token_ids: Sequence[int], salt: str | None) -> list[BlockHash]:
        """The prompt's full-block hashes, exactly as the workers' prefix caches compute them."""
        return hash_prompt_blocks(prompt_token_ids, self.block_size, salt)

    def states(self, hashes: Sequence[BlockHash], candidates: Sequence[Candidate],
               usable_blocks: int) -> list[WorkerState]:
        overlap = self.index.overlap(hashes[:usable_blocks], [c.worker_id for c in candidates])
        return [WorkerState(c.worker_id, overlap[c.worker_id],
                            self.loads.queued_prefill_blocks(c.worker_id),
                            self.loads.active_blocks(c.worker_id), c.overloaded,
                            self.index.num_blocks(c.worker_id))
                for c in candidates]

    def explain(self, prompt_token_ids: Sequence[int], salt: str | None,
                candidates: Sequence[Candidate], policy: Policy | None = None) -> Decision:
        """The decision a route would make now, with every worker's score; changes nothing."""
        return self._decide(prompt_token_ids, salt, candidates, policy or self.policy, False)

    def route(self, request_id: str, prompt_token_ids: Sequence[int], salt: str | None,
              candidates: Sequence[Candidate], policy: Policy | None = None,
              charge_prefill: bool = True) -> Decision:
        """Choose a worker and charge it the request's KV blocks and (unless its prompt
        arrives by transfer: `charge_prefill=False`) its uncached prompt blocks.
        `prompt_token_ids` is every token the worker starts from (a resumed request's output
        included)."""
        decision = self._decide(prompt_token_ids, salt, candidates, policy or self.policy, True)
        prefill = decision.score(decision.chosen).prefill_blocks if charge_prefill else 0
        self.loads.charge(request_id, decision.chosen, len(prompt_token_ids), prefill)
        return decision

    def _decide(self, prompt_token_ids: Sequence[int], salt: str | None,
                candidates: Sequence[Candidate], policy: Policy, commit: bool) -> Decision:
        # the engine never serves a prompt's last token from cache: only these blocks count
        usable = (len(prompt_token_ids) - 1) // self.block_size
        hashes = self.hashes(prompt_token_ids[:usable * self.block_size], salt)
        return decide(policy, usable, self.states(hashes, candidates, usable), commit)
