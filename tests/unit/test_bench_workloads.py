"""Workload generators of `kiln bench`: exact token counts, shared prefixes, seeding, caps."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kiln.bench.config import WorkloadConfig, WorkloadKind
from kiln.bench.tokens import TextMaker, count_tokens
from kiln.bench.workloads import build_workload, default_num_requests
from kiln.testing.tiny import make_tokenizer


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


def ntok(tok, text: str) -> int:
    return count_tokens(tok, text)


@pytest.mark.parametrize("n", [1, 3, 17, 128, 700])
def test_text_maker_hits_exact_counts(tok, n):
    maker = TextMaker(tok, np.random.default_rng(n))
    for _ in range(5):
        assert ntok(tok, maker.text(n)) == n


def test_text_maker_joins_cleanly_after_a_prefix(tok):
    maker = TextMaker(tok, np.random.default_rng(0))
    prefix = maker.text(50)
    for n in (1, 9, 64):
        text = maker.text(n, after=prefix)
        joined = tok.encode(prefix + text, add_special_tokens=False)
        assert joined[:50] == tok.encode(prefix, add_special_tokens=False)
        assert len(joined) == 50 + n


def test_random_workload_lengths_and_seeding(tok):
    config = WorkloadConfig(input_len=40, output_len=12)
    w = build_workload(config, 10, seed=3, tokenizer=tok)
    assert w.num_requests == 10
    for s in w.sessions:
        (turn,) = s.turns
        (msg,) = turn.messages
        assert msg.role == "user" and ntok(tok, msg.content) == 40 == turn.input_tokens
        assert turn.output_len == 12
    assert build_workload(config, 10, 3, tok) == w
    assert build_workload(config, 10, 4, tok) != w


def test_range_ratio_spreads_lengths_within_bounds(tok):
    config = WorkloadConfig(input_len=20, output_len=10, range_ratio=0.5)
    w = build_workload(config, 40, seed=0, tokenizer=tok)
    ins = [s.turns[0].input_tokens for s in w.sessions]
    outs = [s.turns[0].output_len for s in w.sessions]
    assert min(ins) >= 10 and max(ins) <= 30 and len(set(ins)) > 5
    assert min(outs) >= 5 and max(outs) <= 15
    assert all(ntok(tok, s.turns[0].messages[0].content) == s.turns[0].input_tokens
               for s in w.sessions)


def test_shared_prefix_groups_share_exact_system_prompts(tok):
    config = WorkloadConfig(kind=WorkloadKind.SHARED_PREFIX, groups=3, prompts_per_group=4,
                            system_len=60, input_len=16, output_len=8)
    w = build_workload(config, default_num_requests(config), seed=0, tokenizer=tok)
    assert w.num_requests == 12
    systems = [s.turns[0].messages[0] for s in w.sessions]
    assert {m.role for m in systems} == {"system"}
    by_prefix: dict[str, int] = {}
    for m in systems:
        by_prefix[m.content] = by_prefix.get(m.content, 0) + 1
    assert sorted(by_prefix.values()) == [4, 4, 4]
    for s in w.sessions:
        system, user = s.turns[0].messages
        assert ntok(tok, system.content) == 60 and ntok(tok, user.content) == 16
        # the completions endpoint sends system + user joined: still exact, prefix intact
        assert ntok(tok, system.content + user.content) == 76 == s.turns[0].input_tokens
    first_group = [s.turns[0].messages[0].content for s in w.sessions[:4]]
    assert len(set(first_group)) > 1  # shuffled: groups interleave


def test_multi_turn_sessions_share_system_prompt_and_size_each_turn(tok):
    config = WorkloadConfig(kind=WorkloadKind.MULTI_TURN, sessions=3, turns=4, system_len=30,
                            first_input_len=50, input_len=10, output_len=6)
    w = build_workload(config, default_num_requests(config), seed=0, tokenizer=tok)
    assert w.num_requests == 12 and len(w.sessions) == 3
    assert len({s.turns[0].messages[0].content for s in w.sessions}) == 1
    for s in w.sessions:
        first, *rest = s.turns
        assert [m.role for m in first.messages] == ["system", "user"]
        assert ntok(tok, first.messages[1].content) == 50 and first.input_tokens == 80
        for turn in rest:
            (msg,) = turn.messages
            assert msg.role == "user" and ntok(tok, msg.content) == 10 == turn.input_tokens


def test_num_requests_caps_a_workload_with_a_natural_count(tok):
    config = WorkloadConfig(kind=WorkloadKind.MULTI_TURN, sessions=3, turns=4, system_len=5,
                            first_input_len=5, input_len=5, output_len=2)
    w = build_workload(config, 6, seed=0, tokenizer=tok)
    assert w.num_requests == 6 and [len(s.turns) for s in w.sessions] == [4, 2]
    with pytest.raises(ValueError, match="exceeds"):
        build_workload(config, 13, seed=0, tokenizer=tok)


def test_long_context_defaults_make_few_long_prompts(tok):
    config = WorkloadConfig(kind=WorkloadKind.LONG_CONTEXT, input_len=900, output_len=4)
    assert default_num_requests(config) == 8
    w = build_workload(config, 2, seed=0, tokenizer=tok)
    assert [ntok(tok, s.turns[0].messages[0].content) for s in w.sessions] == [900, 900]


def test_jsonl_workload(tok, tmp_path):
    path = tmp_path / "reqs.jsonl"
    rows = [{"prompt": "Paris is the capital of France.", "output_tokens": 7},
            {"messages": [{"role": "system", "content": "be brief"},
                          {"role": "user", "content": "hi"}], "max_tokens": 3},
            {"prompt": "no length given"}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    config = WorkloadConfig(kind=WorkloadKind.JSONL, dataset=str(path), output_len=11)
    assert default_num_requests(config) == 3
    w = build_workload(config, 3, seed=0, tokenizer=tok)
    turns = [s.turns[0] for s in w.sessions]
    assert [t.output_len for t in turns] == [7, 3, 11]
    assert [m.role for m in turns[1].messages] == ["system", "user"]
    assert turns[0].input_tokens == ntok(tok, rows[0]["prompt"])


def test_jsonl_errors_name_the_line(tok, tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "ok"}\n{"output_tokens": 3}\n')
    config = WorkloadConfig(kind=WorkloadKind.JSONL, dataset=str(path))
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        build_workload(config, 2, seed=0, tokenizer=tok)


def test_workload_config_validation():
    with pytest.raises(ValueError, match="--dataset"):
        WorkloadConfig(kind=WorkloadKind.JSONL)
    with pytest.raises(ValueError, match="--range-ratio"):
        WorkloadConfig(range_ratio=1.0)
    with pytest.raises(ValueError, match="--input-len"):
        WorkloadConfig(input_len=0)
