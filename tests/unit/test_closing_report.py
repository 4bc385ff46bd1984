"""The closing budget's count travels like the guard's redraws: the scheduler reports the kept
tokens a token check calls steered (per step, in EngineCoreOutput.num_closing_steered), the
cluster's msgspec encoding keeps it (the sums per sequence: tests/engine/
test_structured_closing_report.py, tests/serve/test_structured_closing.py)."""

from __future__ import annotations

import msgspec

from kiln.config import CacheConfig, SchedulerConfig
from kiln.engine.contract import EngineCoreOutput, RunnerOutput
from kiln.engine.kv_manager import KVCacheManager
from kiln.engine.request import Request
from kiln.engine.scheduler import KEEP, Scheduler, TokenCheck
from kiln.sampling_params import SamplingParams

STEERED, STEERED_REDRAW = 5, 6  # the check's verdicts on these tokens (see `check`)


def check(request: Request, token: int) -> TokenCheck:
    if token == STEERED:
        return TokenCheck(steered=True)
    if token == STEERED_REDRAW:
        return TokenCheck(keep=False, steered=True)
    return KEEP


def steps(sampled: list[int]) -> list[EngineCoreOutput]:
    kv = KVCacheManager(CacheConfig(block_size=4), 16)
    s = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64), kv,
                  max_model_len=64, token_check=check)
    s.add_request(Request("a", [10, 11, 12], SamplingParams(max_tokens=8),
                          eos_token_ids=frozenset({2})))
    outs = []
    for token in sampled:
        out = s.schedule()
        outs += s.update(out, RunnerOutput([[token]]))
    return outs


def test_only_kept_steered_tokens_are_counted():
    outs = steps([7, STEERED, STEERED_REDRAW, STEERED, 7])
    assert [o.num_closing_steered for o in outs] == [0, 1, 0, 1, 0]
    assert [len(o.new_token_ids) for o in outs] == [1, 1, 0, 1, 1]


def test_the_count_survives_the_wire():
    outs = steps([STEERED, 7, STEERED])
    wire = [msgspec.msgpack.decode(msgspec.msgpack.encode(o), type=EngineCoreOutput)
            for o in outs]
    assert [o.num_closing_steered for o in wire] == [1, 0, 1]
