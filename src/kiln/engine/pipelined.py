"""Steps in flight: the engine loop over a pipeline of P stages (kiln.runner.pipeline).

With one step at a time the stages take turns: rank 0, the last stage, samples and
schedules while the first stage waits for the next step, and the first stage waits while
the last finishes. So, as vLLM's virtual engines do, the engine keeps up to P steps in flight,
each of different requests: it schedules a step from the requests not in flight (at most
1/P of the live ones, so the steps stay of a size), submits it (the first stage starts it at
once), and, once P are in flight or nothing more can be scheduled, finishes the oldest
(rank 0 runs the last stage on it and samples) and updates the scheduler with its outputs.
While rank 0 finishes step t, the first stage computes step t + 1.

Why this is safe: a request in flight is neither scheduled nor preempted (`busy`), nor
aborted until its step has finished (`defer_busy`: its blocks stay its own until then, so
no later step gets them while the finishing step may still move KV between them), and every
stage runs the steps in submission order, so KV an in-flight step writes (into a prefix a
later step hits) is written on every stage before any later step reads it.

With tensor-parallel stages the last stage's other ranks run each step together with rank 0
(their all-reduces and the logits gather meet), so they must know when rank 0 finishes one:
`submit` says whether the oldest step is finished right after it (the usual case once the
pipeline is full), and the runner tells them with the step itself, or else on its own when
the step is finished (kiln.runner.pipeline).
"""

from __future__ import annotations

from collections import deque
from typing import Protocol

from kiln.engine.contract import EngineCoreOutput, RunnerOutput, SchedulerOutput
from kiln.engine.request import RequestStatus
from kiln.engine.scheduler import Scheduler


class PipelinedRunner(Protocol):
    def submit(self, sched: SchedulerOutput, finish_oldest: bool) -> None:
        """Start the step down the stages; `execute` finishes it, in submission order.
        `finish_oldest`: the oldest step in flight is executed next, before any other
        submission (ranks that run each step with rank 0 learn it with this step)."""

    def execute(self, sched: SchedulerOutput) -> RunnerOutput: ...

    def release(self, request_ids: list[str]) -> None: ...


class StepPipeline:
    """Up to `depth` submitted steps of disjoint requests, finished oldest first."""

    def __init__(self, scheduler: Scheduler, runner: PipelinedRunner, depth: int):
        self.scheduler, self.runner, self.depth = scheduler, runner, depth
        self.in_flight: deque[SchedulerOutput] = deque()
        self.deferred_aborts: set[str] = set()

    def defer_busy(self, request_ids: list[str]) -> list[str]:
        """Of requests to abort, those not in flight (abort them now); the others are
        aborted as soon as their step has finished."""
        busy = self.busy()
        self.deferred_aborts.update(rid for rid in request_ids if rid in busy)
        return [rid for rid in request_ids if rid not in busy]

    def busy(self) -> frozenset[str]:
        return frozenset(item.request_id for sched in self.in_flight for item in sched.scheduled)

    def step(self) -> tuple[SchedulerOutput | None, list[EngineCoreOutput]]:
        """Submit a step if one can be scheduled, then finish the oldest once the pipeline is
        full (or nothing was added). Returns the finished step (None: none finished) and the
        outputs: its requests', and those of requests ended outside the step (aborts)."""
        live = self.scheduler.num_running + self.scheduler.num_waiting
        sched = self.scheduler.schedule(self.busy(), max(1, -(-live // self.depth)))
        if sched.empty:
            self.runner.release(sched.finished_ids)
            if not self.in_flight:
                return None, self.scheduler.update(sched, RunnerOutput([]))
        else:
            self.runner.submit(sched, finish_oldest=len(self.in_flight) + 1 >= self.depth)
            self.in_flight.append(sched)
            if len(self.in_flight) < self.depth:
                return None, self.scheduler.update(SchedulerOutput([], 0), RunnerOutput([]))
        oldest = self.in_flight.popleft()
        outputs = self.scheduler.update(oldest, self.runner.execute(oldest))
        self._abort_deferred()
        return oldest, outputs

    def _abort_deferred(self) -> None:
        """Abort the deferred requests no longer in flight (their outputs come next step)."""
        ready = self.deferred_aborts - self.busy()
        if ready:
            self.deferred_aborts -= ready
            self.scheduler.finish_requests(sorted(ready), RequestStatus.FINISHED_ABORTED)
