"""Rollback of rejected drafts leaves the KV cache consistent (property-based).

A fake runner records, for every cache slot it writes, which token prefix the KV there
encodes. After every step, each running request's computed positions must hold exactly its
verified prefix (never a rejected draft), reference counts must match the block tables, and
only blocks of verified tokens may be in the prefix cache.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kiln.config import CacheConfig, SchedulerConfig
from kiln.engine.contract import RunnerOutput
from kiln.engine.kv_manager import KVCacheManager
from kiln.engine.request import Request
from kiln.engine.scheduler import Scheduler
from kiln.sampling_params import SamplingParams

BS = 4
EOS = 2


class FakeRunner:
    """Writes the prefix each token's KV would encode into its slot; samples from `data`."""

    def __init__(self):
        self.slots: dict[int, tuple[int, ...]] = {}

    def execute(self, sched, draw) -> RunnerOutput:
        sampled = []
        for item in sched.scheduled:
            prefix = tuple(item.prompt_token_ids + item.output_token_ids)[:item.start_pos]
            for j, token in enumerate(item.token_ids):
                pos = item.start_pos + j
                prefix = prefix + (token,)
                self.slots[item.block_ids[pos // BS] * BS + pos % BS] = prefix
            if not item.samples:
                sampled.append([])
                continue
            drafts = item.token_ids[len(item.token_ids) - item.num_draft_tokens:]
            accepted = draw(st.integers(0, len(drafts)))
            sampled.append(drafts[:accepted] + [draw(st.sampled_from([5, 6, 7, EOS]))])
        return RunnerOutput(sampled)


def check(s: Scheduler, runner: FakeRunner) -> None:
    kv = s.kv
    tables = kv._blocks
    for block in kv.pool.blocks:
        holders = sum(table.count(block) for table in tables.values())
        assert block.ref_cnt == holders
        assert (block.block_id in kv.pool._free) == (holders == 0)
    for r in s.running:
        table = kv.block_ids(r.request_id)
        assert kv.blocks_needed(r.num_computed_tokens) <= len(table)
        assert len(table) <= kv.blocks_needed(r.num_tokens)
        for pos in range(r.num_computed_tokens):  # computed = verified prefix, never a draft
            slot = table[pos // BS] * BS + pos % BS
            assert runner.slots[slot] == tuple(r.all_token_ids[:pos + 1])
        assert kv._num_published.get(r.request_id, 0) <= r.num_tokens // BS


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), num_requests=st.integers(1, 4), num_blocks=st.integers(6, 24),
       budget=st.integers(3, 32))
def test_rollback_keeps_kv_consistent(data, num_requests, num_blocks, budget):
    kv = KVCacheManager(CacheConfig(block_size=BS), num_blocks)
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=budget), kv,
                  max_model_len=64)
    shared = [11, 12, 13, 14, 15, 16]
    for i in range(num_requests):
        tail = data.draw(st.lists(st.integers(20, 23), min_size=1, max_size=6))
        prompt = shared[:data.draw(st.integers(0, 6))] + tail
        s.add_request(Request(f"r{i}", prompt, SamplingParams(max_tokens=12),
                              eos_token_ids=frozenset({EOS}), arrival_time=float(i)))
    runner = FakeRunner()
    for _ in range(60):
        if not s.has_work():
            break
        for r in s.running:
            if r.num_computed_tokens == r.num_tokens - 1:  # decoding: maybe propose
                room = min(r.params.max_tokens - r.num_output_tokens - 1, 64 - r.num_tokens)
                k = data.draw(st.integers(0, max(0, min(3, room))))
                r.spec_token_ids = data.draw(st.lists(st.integers(5, 8), min_size=k,
                                                      max_size=k))
        sched = s.schedule()
        s.update(sched, runner.execute(sched, data.draw) if not sched.empty
                 else RunnerOutput([]))
        check(s, runner)
    assert not s.has_work()
    assert kv.pool.num_free_blocks == num_blocks
