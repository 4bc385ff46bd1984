"""Adaptive speculation: how many drafts to ask for this step (0 = none).

Speculation trades compute for steps: a step that verifies k drafts per sequence costs more
than a plain one (k more query tokens per sequence, plus the proposer's own time) and yields
1 + (accepted drafts) tokens per sequence instead of 1. Whether that pays depends on the
batch (at batch 1 a CPU or GPU forward is weight-bound and extra tokens are nearly free; at
large batches it is compute-bound and they are not) and on the traffic (acceptance). So per
step we pick the k with the most expected tokens per second, from measurements:

  tokens(k) = 1 + sum_{i=1..k} a_1 * ... * a_i    a_i: measured P(draft i was proposed and
                                                  accepted | i were asked for, i - 1 accepted)
  cost(b, k) = measured seconds per sequence of a step at batch size bucket b verifying k
               drafts, proposer time included (decode-only steps; the median of the last
               few, so a stall caused by someone else's process cannot flip the choice)
  k* = argmax_k tokens(k) / cost(b, k)

Arms never measured in a bucket are tried first (a few steps each); afterwards one step in
`explore_every` re-measures a neighbour of the best arm, so costs and acceptance keep up with
load and traffic (k = 0 never measures acceptance, so a switched-off speculator is retried
this way). Exploration bounds the worst case: with k* = 0, a neighbour probe costs one step in
`explore_every` at most (cost(b, 1) / cost(b, 0) - 1) extra.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field


def batch_bucket(batch_size: int) -> int:
    """1, 2, 3, 4, then powers of two (5-8 -> 8, 9-16 -> 16, ...)."""
    if batch_size <= 4:
        return max(1, batch_size)
    return 1 << (batch_size - 1).bit_length()


@dataclass
class _Arm:
    recent: deque = field(default_factory=lambda: deque(maxlen=9))  # seconds per sequence
    samples: int = 0

    @property
    def seconds(self) -> float:
        return statistics.median(self.recent)


@dataclass
class AdaptiveK:
    max_k: int
    enabled: bool = True  # False: always max_k
    max_batch_size: int | None = None  # no drafts above this many sequences
    explore_every: int = 24  # one probe step in this many, per bucket
    min_samples: int = 3  # measurements before an arm is trusted
    acceptance_decay: float = 0.995  # per verified draft: old evidence fades
    _arms: dict[tuple[int, int], _Arm] = field(default_factory=dict)
    _tried: list[float] = field(default_factory=list)  # per draft position (decayed counts)
    _accepted: list[float] = field(default_factory=list)
    _steps: dict[int, int] = field(default_factory=dict)  # decisions per bucket

    def __post_init__(self):
        self._tried = [0.0] * self.max_k
        self._accepted = [0.0] * self.max_k

    # -- estimates ------------------------------------------------------------------------

    def acceptance(self, position: int) -> float:
        """P(draft `position` (1-based) proposed and accepted | the ones before were);
        prior 0.5."""
        i = position - 1
        return (self._accepted[i] + 1.0) / (self._tried[i] + 2.0)

    def expected_tokens(self, k: int) -> float:
        total, chain = 1.0, 1.0
        for i in range(1, k + 1):
            chain *= self.acceptance(i)
            total += chain
        return total

    def cost(self, batch_size: int, k: int) -> float | None:
        arm = self._arms.get((batch_bucket(batch_size), k))
        return arm.seconds if arm and arm.samples else None

    # -- decisions ------------------------------------------------------------------------

    def choose(self, batch_size: int) -> int:
        """k for a step with `batch_size` sequences decoding."""
        if not self.enabled:
            return self.max_k
        if batch_size < 1 or (self.max_batch_size is not None
                              and batch_size > self.max_batch_size):
            return 0
        bucket = batch_bucket(batch_size)
        n = self._steps[bucket] = self._steps.get(bucket, 0) + 1
        untried = [k for k in range(self.max_k, -1, -1)
                   if self._arms.get((bucket, k), _Arm()).samples < self.min_samples]
        if untried:
            return untried[0]
        best = max(range(self.max_k + 1),
                   key=lambda k: self.expected_tokens(k) / self._arms[(bucket, k)].seconds)
        if n % self.explore_every == 0:  # probe a neighbour, alternating sides
            probes = [k for k in (best - 1, best + 1) if 0 <= k <= self.max_k]
            return probes[(n // self.explore_every) % len(probes)]
        return best

    # -- measurements ---------------------------------------------------------------------

    def observe_cost(self, batch_size: int, k: int, seconds: float) -> None:
        """One decode-only step of `batch_size` sequences verifying `k` drafts each. Kept per
        sequence, so batch sizes sharing a bucket compare."""
        arm = self._arms.setdefault((batch_bucket(batch_size), k), _Arm())
        arm.recent.append(seconds / batch_size)
        arm.samples += 1

    def observe_acceptance(self, num_asked: int, num_accepted: int) -> None:
        """One verification of a request asked for `num_asked` drafts: drafts 1..num_accepted
        passed, draft num_accepted + 1 failed (rejected, or never proposed)."""
        for i in range(min(num_asked, self.max_k)):
            self._tried[i] = self._tried[i] * self.acceptance_decay + 1.0
            self._accepted[i] *= self.acceptance_decay
            if i < num_accepted:
                self._accepted[i] += 1.0
            else:
                break
