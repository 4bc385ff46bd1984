"""Steps in flight (kiln.engine.pipelined): the scheduler leaves busy requests alone, and the
step pipeline submits steps of disjoint requests and finishes them oldest first."""

from __future__ import annotations

from kiln.engine.contract import RunnerOutput, SchedulerOutput
from kiln.engine.pipelined import StepPipeline
from kiln.engine.request import RequestStatus
from tests.unit.test_scheduler import make, req, run_step


def ids(sched: SchedulerOutput) -> list[str]:
    return [item.request_id for item in sched.scheduled]


def test_busy_requests_are_neither_scheduled_nor_preempted():
    s = make(num_blocks=4, caching=False)
    s.add_request(req("a", 7, max_tokens=10, t0=0))  # 2 blocks each
    s.add_request(req("b", 7, max_tokens=10, t0=1))
    run_step(s)
    assert ids(s.schedule(busy=frozenset({"a"}))) == ["b"]
    s = make(num_blocks=4, caching=False)
    s.add_request(req("a", 7, max_tokens=10, t0=0))
    s.add_request(req("b", 7, max_tokens=10, t0=1))
    run_step(s)
    run_step(s)  # 8 tokens each: the blocks are full
    # a needs a third block; b is in flight, so a gives way itself
    assert ids(s.schedule(busy=frozenset({"b"}))) == []
    assert s.requests["a"].status == RequestStatus.PREEMPTED
    assert s.requests["b"].status == RequestStatus.RUNNING


def test_max_seqs_caps_one_step_not_the_running_set():
    s = make()
    for i, rid in enumerate("abc"):
        s.add_request(req(rid, 3, t0=i))
    assert ids(s.schedule(max_seqs=2)) == ["a", "b"]
    assert ids(s.schedule(busy=frozenset({"a", "b"}), max_seqs=2)) == ["c"]


class RecordingRunner:
    """A runner that samples token 7 for every sampling request and records the order."""

    def __init__(self):
        self.log: list[tuple[str, list[str]]] = []
        self.finishes: list[bool] = []  # each submission's finish_oldest

    def submit(self, sched: SchedulerOutput, finish_oldest: bool) -> None:
        self.log.append(("submit", ids(sched)))
        self.finishes.append(finish_oldest)

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        self.log.append(("execute", ids(sched)))
        return RunnerOutput([[7] if item.samples else [] for item in sched.scheduled])

    def release(self, request_ids: list[str]) -> None:
        pass


def test_two_steps_in_flight_of_disjoint_requests_finish_oldest_first():
    s, runner = make(), RecordingRunner()
    for i, rid in enumerate("abcd"):
        s.add_request(req(rid, 3, max_tokens=2, t0=i))
    pipeline = StepPipeline(s, runner, depth=2)
    finished, outputs = pipeline.step()  # half the live requests go first
    assert finished is None and outputs == []
    finished, outputs = pipeline.step()  # the other half: the pipeline is full
    assert ids(finished) == ["a", "b"] and [o.new_token_ids for o in outputs] == [[7], [7]]
    pipeline.step()  # a and b again, while c and d are in flight
    assert runner.log == [("submit", ["a", "b"]), ("submit", ["c", "d"]),
                          ("execute", ["a", "b"]), ("submit", ["a", "b"]),
                          ("execute", ["c", "d"])]
    while s.has_work() or pipeline.in_flight:
        pipeline.step()
    assert all(not r for r in [s.requests, pipeline.in_flight])
    assert s.kv.stats().used_blocks == 0


def test_a_submission_says_whether_the_oldest_step_finishes_next():
    """Tensor-parallel stages learn from it when rank 0 runs a step (kiln.runner.pipeline)."""
    s, runner = make(), RecordingRunner()
    for i, rid in enumerate("abcd"):
        s.add_request(req(rid, 3, max_tokens=2, t0=i))
    pipeline = StepPipeline(s, runner, depth=2)
    pipeline.step()
    assert runner.finishes == [False]  # one step in flight: the pipeline is not full
    pipeline.step()
    assert runner.finishes == [False, True] and runner.log[-1] == ("execute", ["a", "b"])
    # a lone request: its step is finished by the next step(), which has nothing to submit
    s, runner = make(), RecordingRunner()
    s.add_request(req("a", 3, max_tokens=2, t0=0))
    pipeline = StepPipeline(s, runner, depth=2)
    pipeline.step()
    pipeline.step()
    assert runner.finishes == [False] and runner.log == [("submit", ["a"]), ("execute", ["a"])]


def test_an_aborted_request_in_flight_keeps_its_blocks_until_its_step_ends():
    s, runner = make(), RecordingRunner()
    s.add_request(req("a", 3, max_tokens=4, t0=0))
    s.add_request(req("b", 3, max_tokens=4, t0=1))
    pipeline = StepPipeline(s, runner, depth=2)
    pipeline.step()  # a goes first (half of the two)
    assert pipeline.defer_busy(["a", "b"]) == ["b"]  # b waits: aborted at once
    s.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)
    assert s.kv.block_ids("a")  # a's step may still move KV between its blocks
    _, outputs = pipeline.step()  # nothing else to schedule: a's step ends, then a
    assert [(o.request_id, o.finish_reason) for o in outputs] == [("b", "abort"), ("a", None)]
    assert "a" not in s.requests and s.kv.stats().used_blocks == 0
    _, outputs = pipeline.step()
    assert [(o.request_id, o.finish_reason) for o in outputs] == [("a", "abort")]
