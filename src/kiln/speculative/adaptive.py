"""Adaptive speculation: how many drafts to ask for this step (0 = none).

Speculation trades compute for steps: a step that verifies k drafts per sequence costs more
than a plain one (k more query tokens per sequence, plus the proposer's own time) and yields
1 + (accepted drafts) tokens per sequence instead of 1. Whether that pays depends on the
batch (at batch 1 a CPU or GPU forward is weight-bound and extra tokens are nearly free; at
large batches it is compute-bound and they are not) and on the traffic (acceptance). So per
step we pick the k with the most expected tokens per second, from measurements:

  tokens(k) = 1 + sum_{i=1..k} a_1 * ... * a_i    a_i: measured P(draft i was proposed and
                                                  accepted | i were asked for, i - 1 accepted),
                                                  averaged over the requests to draft for
  step(k)   = (m * tokens(k) + (b - m)) / b      per sequence of a step of b where m draft
                                                  (lookup drafts only where it has a match)
  cost(b, k) = measured seconds per sequence of a step at batch size bucket b verifying k
               drafts, proposer time included (decode-only steps; the lower quartile of
               the last 9, so a stall caused by someone else's process cannot flip the
               choice, nor make an arm that was probed only a few times look dear). A
               drafting arm keeps its steps relative to cost(b, 0) at the time they ran,
               so cost(b, k) = (its lower-quartile ratio) * cost(b, 0): on a shared machine
               absolute step times drift 2x within minutes, and an arm probed in a quiet
               moment must not look cheap against a baseline measured in a busy one
  k* = argmax_k step(k) / cost(b, k), over k = 0 and the k that beat k = 0 by 10%
       (a draining batch, no request waiting: min over its requests of tokens per step
       over tokens left, in place of step(k): it lasts as long as its slowest request)

Acceptance is judged per request: each keeps its own counts (fading by 0.95 per
verification), which start from the estimate over all traffic (fading by 0.995) worth two
verifications. Traffic shifts (a server's code requests give way to prose, where lookup's
drafts are accepted half as often): one global estimate would keep the new requests drafting
on the old traffic's acceptance for hundreds of verifications, while their own misses switch
them off in a few (the unit tests' synthetic batch of 8: 6 steps rather than 36). A request
left without drafts has its own counts fade the same way, back toward the global estimate, so
a few unlucky misses do not switch it off for good.

Arms never measured in a bucket are tried first (a few steps each, k = 0 before the drafting
arms, which are measured against it); afterwards a probe step re-measures a neighbour of the best arm or k = 0 (in turn), so costs and acceptance keep up
with load and traffic (k = 0 never measures acceptance, so a switched-off speculator is
retried this way; and k = 0's cost, the baseline, never goes stale while drafting wins). Probes
start one step in `explore_every`; each probe that finds the same best arm as the one before
doubles the interval (up to `max_explore_every`), and a change of best arm resets it. So a
speculator that does not pay costs at most (cost(b, 1) / cost(b, 0) - 1) / interval extra,
and a dear probe waits longer, until that is at most `probe_budget` (0.5%): a head's probe at
batch 8 costs 2-2.3 plain steps here, one in 260 rather than 96. In
the unit tests' synthetic machine, 96 rather than a fixed 24 cuts that overhead from 4.2% to
1.1% and takes 1,204 rather than 772 steps to switch a speculator back on when its drafts start
being accepted; the 10% margin drafting must promise over k = 0 makes that 2,015 steps (and
keeps a draft model drafting at batch 8 on this machine, where it cost 10-17%, off). (A head's
probe is dearer than its k = 1 step suggests: it first catches up on every position it
skipped. At fixed 1-in-24 probes heads ran at 0.93-0.94x of off at batch 8
on this machine; docs/decisions/0007.)
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field


def batch_bucket(batch_size: int) -> int:
    """1, 2, 3, 4, then powers of two (5-8 -> 8, 9-16 -> 16, ...)."""
    if batch_size <= 4:
        return max(1, batch_size)
    return 1 << (batch_size - 1).bit_length()


@dataclass
class _Arm:
    recent: deque = field(default_factory=lambda: deque(maxlen=9))  # seconds per sequence
    # (k = 0), or per sequence relative to the baseline's cost when it ran (k >= 1)
    samples: int = 0

    @property
    def seconds(self) -> float:
        """The lower quartile of the recent samples: interference from other processes
        only ever adds time, and an arm probed a few times must not look dearer than it is
        because one of its few samples was unlucky."""
        return sorted(self.recent)[len(self.recent) // 4]


@dataclass
class AdaptiveK:
    max_k: int
    enabled: bool = True  # False: always max_k
    max_batch_size: int | None = None  # no drafts above this many sequences
    explore_every: int = 24  # first probe interval (steps), per bucket
    max_explore_every: int = 96  # the interval doubles up to this while the best arm holds
    min_samples: int = 3  # measurements before an arm is trusted
    margin: float = 0.1  # drafting must promise this much more than no drafts
    probe_budget: float = 0.005  # a dear probe waits until its extra cost, spread over the
    # steps since the last one, is at most this share of them
    acceptance_decay: float = 0.995  # per verified draft: old evidence fades
    request_prior: float = 2.0  # a request's own record starts as this many verifications
    # of the global estimate...
    request_decay: float = 0.95  # ...and its own verifications fade faster than the global
    _arms: dict[tuple[int, int], _Arm] = field(default_factory=dict)  # (bucket, k >= 1)
    _baseline: dict[int, _Arm] = field(default_factory=dict)  # bucket -> the k = 0 arm
    _tried: list[float] = field(default_factory=list)  # per draft position (decayed counts)
    _accepted: list[float] = field(default_factory=list)
    _requests: dict[str, tuple[list[float], list[float]]] = field(default_factory=dict)
    # request id -> its own (tried, accepted) per draft position (decayed counts)
    _steps: dict[int, int] = field(default_factory=dict)  # decisions per bucket
    _probe: dict[int, tuple[int, int, int, int]] = field(default_factory=dict)  # bucket ->
    # (next probe step, interval, best arm at the last probe, probes so far)

    def __post_init__(self):
        self._tried = [0.0] * self.max_k
        self._accepted = [0.0] * self.max_k

    # -- estimates ------------------------------------------------------------------------

    def acceptance(self, position: int, request_id: str | None = None) -> float:
        """P(draft `position` (1-based) proposed and accepted | the ones before were): over
        all requests (prior 0.5), or for one request (its own verifications, with the global
        estimate as the prior, worth `request_prior` of them)."""
        i = position - 1
        overall = (self._accepted[i] + 1.0) / (self._tried[i] + 2.0)
        record = self._requests.get(request_id) if request_id is not None else None
        if record is None:
            return overall
        tried, accepted = record
        return (accepted[i] + self.request_prior * overall) / (tried[i] + self.request_prior)

    def expected_tokens(self, k: int, request_ids: Sequence[str] = ()) -> float:
        """Tokens per sequence from a step verifying k drafts: the mean over `request_ids`
        (each by its own record), else over all traffic."""
        if not request_ids:
            return self._expected_tokens(k, None)
        return sum(self._expected_tokens(k, rid) for rid in request_ids) / len(request_ids)

    def _expected_tokens(self, k: int, request_id: str | None) -> float:
        total, chain = 1.0, 1.0
        for i in range(1, k + 1):
            chain *= self.acceptance(i, request_id)
            total += chain
        return total

    def cost(self, batch_size: int, k: int) -> float | None:
        bucket = batch_bucket(batch_size)
        if not self._arm(bucket, k).samples:
            return None
        return self._seconds(bucket, k)

    def _seconds(self, bucket: int, k: int) -> float:
        """Seconds per sequence of a step verifying k drafts (k >= 1: its ratio to the
        baseline times the baseline's current cost)."""
        base = self._arm(bucket, 0).seconds
        return base if k == 0 else self._arm(bucket, k).seconds * base

    def _arm(self, bucket: int, k: int) -> _Arm:
        if k == 0:
            return self._baseline.setdefault(bucket, _Arm())
        return self._arms.setdefault((bucket, k), _Arm())

    def share_baseline(self, other: AdaptiveK) -> None:
        """Measure "no drafts" together with `other`: two controllers choosing k for two
        sources of drafts (n-gram lookup and a model) in one engine share the baseline
        every drafting arm is judged against."""
        self._baseline = other._baseline

    def shares_baseline(self, other: AdaptiveK) -> bool:
        return self._baseline is other._baseline

    @property
    def verifications(self) -> float:
        """Verifications of this controller's drafts so far (decayed, over all traffic)."""
        return self._tried[0] if self._tried else 0.0

    # -- decisions ------------------------------------------------------------------------

    def choose(self, batch_size: int, request_ids: Sequence[str] = (),
               left: Mapping[str, int] | None = None) -> int:
        """k for a step with `batch_size` sequences decoding, drafting for `request_ids`
        (judged by their own acceptance; none given: by all traffic's). `left`: in a
        draining batch (no request waiting for its slot), the tokens each of the batch's
        requests has left to make, drafting or not (see `_best`)."""
        if not self.enabled:
            return self.max_k
        if batch_size < 1 or (self.max_batch_size is not None
                              and batch_size > self.max_batch_size):
            return 0
        bucket = batch_bucket(batch_size)
        n = self._steps[bucket] = self._steps.get(bucket, 0) + 1
        # the baseline first: drafting arms are measured relative to it
        untried = [k for k in (0, *range(self.max_k, 0, -1))
                   if self._arm(bucket, k).samples < self.min_samples]
        if untried:
            return untried[0]
        best = self._best(batch_size, request_ids, left)
        due, interval, last_best, count = self._probe.setdefault(
            bucket, (n + self.explore_every, self.explore_every, best, 0))
        if n < due:
            if best == 0:
                self._fade(request_ids)
            return best
        interval = _next_interval(interval, best == last_best, self.explore_every,
                                  self.max_explore_every)
        # the neighbours and k = 0 in turn: "no drafts" is the baseline every other arm is
        # judged against, so its cost must not go stale while drafting wins
        probes = sorted({k for k in (0, best - 1, best + 1) if 0 <= k <= self.max_k} - {best})
        probe = probes[count % len(probes)]
        interval = max(interval, self._dear_interval(bucket, probe, best))
        self._probe[bucket] = (n + interval, interval, best, count + 1)
        return probe

    def _dear_interval(self, bucket: int, probe: int, best: int) -> int:
        """Steps a probe of arm `probe` must wait so that its extra cost over `best`'s step
        is at most `probe_budget` of them: at batch 8 a head's probe costs 2-2.3 plain
        steps here (it catches up on every position since the last one), 1.3-1.7% of the
        time at one probe in 96 steps."""
        ratio = self._seconds(bucket, probe) / self._seconds(bucket, best)
        return math.ceil((ratio - 1) / self.probe_budget) if ratio > 1 else 0

    def _best(self, batch_size: int, request_ids: Sequence[str],
              left: Mapping[str, int] | None = None) -> int:
        """The k with the most expected tokens per second among those that beat no drafts
        by `margin`: estimates are noisy, and a wrong "drafting pays" costs far more than a
        missed marginal gain (at large batches a step verifying drafts is dear, and sequences
        that race ahead leave the others decoding in smaller batches). Tokens are the step's:
        where only some of the batch would draft (`request_ids`, the ones lookup has a
        match for), the others make one token each, so drafting for 2 of 8 must pay with
        what those 2 gain, not as if all 8 gained it.

        A draining batch (`left` given) is done when its slowest request is: the rate is
        min over its requests of (tokens per step) / (tokens left), per second. Drafts that
        race some requests ahead of the others free slots nobody fills and make the steps of
        the ones still behind dearer: on the documentation's prose, closed batches of 8 with
        lookup or a head ran at 0.89-0.96x of no drafts, judged by the step's tokens."""
        bucket = batch_bucket(batch_size)
        if left:
            drafting = set(request_ids)
            rate = [min((self._expected_tokens(k, rid) if rid in drafting else 1.0) / max(n, 1)
                        for rid, n in left.items()) / self._seconds(bucket, k)
                    for k in range(self.max_k + 1)]
        else:
            drafting = min(len(request_ids), batch_size) if request_ids else batch_size
            rest = (batch_size - drafting) / batch_size
            rate = [((1 - rest) * self.expected_tokens(k, request_ids) + rest)
                    / self._seconds(bucket, k) for k in range(self.max_k + 1)]
        paying = [k for k in range(1, self.max_k + 1) if rate[k] > rate[0] * (1 + self.margin)]
        return max(paying, key=lambda k: rate[k], default=0)

    # -- measurements ---------------------------------------------------------------------

    def observe_cost(self, batch_size: int, k: int, seconds: float) -> None:
        """One decode-only step of `batch_size` sequences verifying `k` drafts each. Kept per
        sequence, so batch sizes sharing a bucket compare."""
        bucket = batch_bucket(batch_size)
        arm, base = self._arm(bucket, k), self._arm(bucket, 0)
        if k == 0:
            arm.recent.append(seconds / batch_size)
        elif base.samples:
            arm.recent.append(seconds / batch_size / base.seconds)
        else:  # nothing to measure it against yet (the baseline is tried first)
            return
        arm.samples += 1

    def observe_acceptance(self, num_asked: int, num_accepted: int,
                           request_id: str | None = None) -> None:
        """One verification of a request asked for `num_asked` drafts: drafts 1..num_accepted
        passed, draft num_accepted + 1 failed (rejected, or never proposed). Counted over all
        traffic and, given its id, in the request's own record (until `forget`)."""
        _count(self._tried, self._accepted, num_asked, num_accepted, self.acceptance_decay)
        if request_id is not None:
            tried, accepted = self._requests.setdefault(
                request_id, ([0.0] * self.max_k, [0.0] * self.max_k))
            _count(tried, accepted, num_asked, num_accepted, self.request_decay)

    def _fade(self, request_ids: Sequence[str]) -> None:
        """Requests left without drafts: their own evidence fades toward the global estimate
        (as a verification would), so one that a few misses switched off is tried again."""
        for rid in request_ids:
            if (record := self._requests.get(rid)) is not None:
                for counts in record:
                    counts[:] = [c * self.request_decay for c in counts]

    def forget(self, request_ids: Iterable[str]) -> None:
        """Drop finished requests' own records."""
        for rid in request_ids:
            self._requests.pop(rid, None)


def _count(tried: list[float], accepted: list[float], num_asked: int, num_accepted: int,
           decay: float) -> None:
    """Decayed per-position counts: positions 1..num_accepted passed, the next one failed."""
    for i in range(min(num_asked, len(tried))):
        tried[i] = tried[i] * decay + 1.0
        accepted[i] *= decay
        if i < num_accepted:
            accepted[i] += 1.0
        else:
            break


@dataclass
class TreeChoice:
    """Trees or chains, in the steps where trees are allowed (adaptive speculation's choice
    of shape). A tree step verifies up to `tree_size` drafts and accepts more of them than a
    chain; whether that pays depends on how a step's cost grows with its query tokens: on an
    AVX-512 BF16 CPU a 16-token step costs 1.6x a 1-token one; on an AVX2 CPU, where bf16
    weights are widened to fp32 (a 576x1536 linear: 329 us for 16 tokens, 98 for 2), lookup's
    15-draft trees ran at 1.20x of no drafts on code and its chains at 1.36x (docs/decisions/0007).
    Each shape has its own controllers for k (its own acceptance and costs); this picks the shape with more tokens per unit of cost, measured
    over whole decode steps (k = 0 steps included: what each shape's controller actually
    makes of its steps). Each shape gets `warmup` steps first (trees first), then the better
    one runs and the other is re-measured in a probe step, first after `probe_every` steps;
    each probe that leaves the same shape best doubles the interval (up to
    `max_probe_every`), a change of best shape resets it (as AdaptiveK's probes do: on the
    AVX2 CPU lookup's trees made 0.9 tokens per unit of cost and its chains 1.2-2.4, so a
    probe one step in 12 cost about 4%)."""

    warmup: int = 12
    probe_every: int = 12
    max_probe_every: int = 48
    decay: float = 0.9  # per observation of a shape: old steps fade (load and text change)
    _tokens: list[float] = field(default_factory=lambda: [0.0, 0.0])  # [chain, tree]
    _cost: list[float] = field(default_factory=lambda: [0.0, 0.0])
    _seen: list[int] = field(default_factory=lambda: [0, 0])
    _steps: int = 0
    _probe: tuple[int, int, bool] | None = None  # (next probe step, interval, best then)

    def choose(self) -> bool:
        """True: this step drafts trees."""
        for tree in (True, False):
            if self._seen[tree] < self.warmup:
                return tree
        self._steps += 1
        best = self.rate(True) > self.rate(False)
        if self._probe is None:
            self._probe = (self.probe_every, self.probe_every, best)
        due, interval, last_best = self._probe
        if self._steps < due:
            return best
        interval = _next_interval(interval, best == last_best, self.probe_every,
                                  self.max_probe_every)
        self._probe = (self._steps + interval, interval, best)
        return not best

    def observations(self, tree: bool) -> int:
        """Decode steps of this shape observed so far."""
        return self._seen[tree]

    def rate(self, tree: bool) -> float:
        """Tokens per sequence per unit of cost (1 = a step without drafts)."""
        return self._tokens[tree] / self._cost[tree] if self._cost[tree] else 0.0

    def observe(self, tree: bool, tokens: float, cost: float) -> None:
        """One decode step of this shape: tokens per sequence it made, and its cost per
        sequence relative to a step without drafts."""
        self._tokens[tree] = self._tokens[tree] * self.decay + tokens
        self._cost[tree] = self._cost[tree] * self.decay + cost
        self._seen[tree] += 1


def _next_interval(interval: int, same_best: bool, first: int, most: int) -> int:
    """Steps to the next probe: doubled (up to `most`) while probes keep finding the same
    best choice, back to `first` when it changes."""
    return min(2 * interval, most) if same_best else first
