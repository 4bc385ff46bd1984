"""N-gram lookup, adaptive draft length, and speculator naming: pure CPU logic."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kiln.config_speculative import (
    DEFAULT_TREE_DRAFTS,
    HEAD_TREE_DRAFTS,
    HEAD_TREE_MIN_PROB,
    HEAD_TREE_WIDTH,
    SpeculativeConfig,
)
from kiln.speculative.adaptive import AdaptiveK, TreeChoice, batch_bucket
from kiln.speculative.ngram import TokenIndex, ngram_match, ngram_tree, propose_ngram
from kiln.speculative.proposer import Draft, DraftTrie
from kiln.speculative.resolve import resolve_speculative_config
from kiln.speculative.speculator import tokens_left


def ngram(tokens, k=3, n_min=1, n_max=4):
    return propose_ngram(np.asarray(tokens), k, n_min, n_max)


def test_ngram_proposes_what_followed_the_latest_longest_match():
    #        0  1  2  3  4  5  6  7  8  9
    seq = [1, 2, 3, 4, 9, 1, 2, 3, 5, 1, 2, 3]
    # suffix [1, 2, 3] last occurred at 5..7 (followed by 5, 1, 2), before that at 0..2
    assert ngram(seq) == [5, 1, 2]
    assert ngram(seq, k=1) == [5]
    assert ngram(seq, k=5) == [4, 9, 1, 2, 3]  # only the earlier one is followed by 5
    # a longer suffix wins over a more recent shorter one
    assert ngram([7, 8, 9, 4, 1, 9, 0, 7, 8, 9], n_max=3) == [4, 1, 9]
    # ngram_match also says how long the matched suffix was (0: no match)
    assert ngram_match(np.asarray([7, 8, 9, 4, 1, 9, 0, 7, 8, 9]), 3, 1, 4) == ([4, 1, 9], 3)
    assert ngram_match(np.asarray([5, 6, 5]), 2, 1, 4) == ([6, 5], 1)
    assert ngram_match(np.asarray([1, 2, 3]), 3, 1, 4) == ([], 0)


def _lookup_by_windows(tokens, k, n_min, n_max):
    """The definition, spelled out: for n from n_max down, every earlier window equal to
    the last n tokens; the latest one followed by k tokens, else the earliest."""
    size = len(tokens)
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        starts = [s for s in range(size - n) if tokens[s:s + n] == tokens[size - n:]]
        if starts:
            full = [s for s in starts if s + n + k <= size]
            start = (full[-1] if full else starts[0]) + n
            return tokens[start:start + k], n
    return [], 0


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=40), st.integers(1, 4), st.integers(1, 3),
       st.integers(0, 3))
def test_ngram_lookup_matches_its_definition(tokens, k, n_min, extra):
    # lookup reads an index of where each token occurs, extending the last token's earlier
    # occurrences backwards: same answer as the definition, whether the index was built at
    # once or kept up to date token by token (as the engine does for each request)
    want = _lookup_by_windows(tokens, k, n_min, n_min + extra)
    assert ngram_match(np.asarray(tokens, dtype=np.int64), k, n_min, n_min + extra) == want
    index = TokenIndex()
    for i in range(len(tokens) + 1):
        index.update(tokens[:i])
    assert index.match(k, n_min, n_min + extra) == want


def test_ngram_without_a_match_proposes_nothing():
    assert ngram([1, 2, 3, 4]) == []
    assert ngram([5]) == []
    assert ngram([1, 2, 1], n_min=2) == []


def test_ngram_continuation_may_run_into_the_suffix_itself():
    assert ngram([3, 3, 3, 3]) == [3]  # suffix [3,3,3] seen at 0, only one token follows
    assert ngram([3, 3, 3, 3], n_max=1) == [3, 3, 3]  # the earliest [3] has 3 followers


def test_batch_buckets():
    assert [batch_bucket(b) for b in (1, 2, 3, 4, 5, 8, 9, 16, 17)] == [1, 2, 3, 4, 8, 8, 16,
                                                                         16, 32]


def drive(adaptive: AdaptiveK, batch: int, step_cost, accept_len, steps: int) -> list[int]:
    """Run the controller against a synthetic machine; returns the chosen k per step."""
    chosen = []
    for _ in range(steps):
        k = adaptive.choose(batch)
        chosen.append(k)
        for _ in range(batch):
            adaptive.observe_acceptance(k, min(k, accept_len))
        adaptive.observe_cost(batch, k, step_cost(batch, k))
    return chosen


def test_adaptive_drafts_fully_when_verification_is_nearly_free():
    adaptive = AdaptiveK(max_k=3)
    chosen = drive(adaptive, 1, lambda b, k: 1.0 + 0.05 * k, accept_len=3, steps=200)
    assert chosen[-100:].count(3) >= 90


def test_adaptive_switches_off_when_drafts_cost_more_than_they_bring():
    adaptive = AdaptiveK(max_k=3)
    # compute-bound large batch: every extra query token costs its full share
    chosen = drive(adaptive, 32, lambda b, k: b * (1 + k), accept_len=1, steps=300)
    assert chosen[-200:].count(0) >= 180
    # the probes bound the cost: under 5% over always-off, and falling as they back off
    cost = sum(1 + k for k in chosen[-200:]) / 200
    assert cost < 1.05
    later = drive(adaptive, 32, lambda b, k: b * (1 + k), accept_len=1, steps=1500)
    assert sum(1 + k for k in later[-1000:]) / 1000 < 1.02


def test_adaptive_dear_probes_wait_until_they_cost_half_a_percent():
    """A head's probe at batch 8 costs 2-2.3 plain steps (it catches up on every position
    since the last one): one in 96 steps would be 1.3% of the time for nothing."""
    def probes(budget: float) -> tuple[int, float]:
        adaptive = AdaptiveK(max_k=3, probe_budget=budget)
        chosen = drive(adaptive, 8, lambda b, k: b * (1 + 1.3 * k), accept_len=0, steps=4000)
        late = chosen[1000:]
        return sum(k > 0 for k in late), sum(1.3 * k for k in late) / len(late)
    dear, overhead = probes(0.005)
    plain, plain_overhead = probes(1.0)  # no waiting beyond the usual backing off
    assert overhead <= 0.006 < plain_overhead, (overhead, plain_overhead)
    assert 0 < dear <= plain / 2, (dear, plain)


def test_adaptive_backed_off_probes_still_notice_better_traffic():
    adaptive = AdaptiveK(max_k=3)
    cost = lambda b, k: 1.0 + 0.3 * k  # noqa: E731
    drive(adaptive, 1, cost, accept_len=0, steps=2000)  # drafts never accepted: off, backed off
    chosen = drive(adaptive, 1, cost, accept_len=3, steps=3000)  # on after ~2,000 steps
    assert chosen[-100:].count(3) >= 90


def test_adaptive_probes_both_neighbours_and_off_in_turn():
    """With k = 1 best, probes alternate k = 0 and k = 2 (also once the interval has backed
    off to multiples of the first one); with k = 3 best, they take turns at 2 and at 0 (the
    baseline's cost is re-measured too)."""
    adaptive = AdaptiveK(max_k=3)
    cost = lambda b, k: 1.0 + 0.5 * k  # noqa: E731  k = 1 pays with one draft accepted
    chosen = drive(adaptive, 1, cost, accept_len=1, steps=1200)
    late = chosen[400:]
    assert late.count(1) >= len(late) - 20
    assert late.count(0) >= 3 and late.count(2) >= 3
    adaptive = AdaptiveK(max_k=3)
    chosen = drive(adaptive, 1, lambda b, k: 1.0 + 0.05 * k, accept_len=3, steps=1200)
    late = chosen[400:]
    assert late.count(3) >= len(late) - 20
    assert late.count(0) >= 3 and late.count(2) >= 3 and late.count(1) == 0


def test_adaptive_follows_acceptance_down():
    adaptive = AdaptiveK(max_k=3)
    cost = lambda b, k: 1.0 + 0.3 * k  # noqa: E731
    drive(adaptive, 1, cost, accept_len=3, steps=100)
    chosen = drive(adaptive, 1, cost, accept_len=0, steps=1500)
    assert chosen[-100:].count(0) >= 90


def test_two_controllers_share_the_no_drafts_baseline():
    """ngram_first's lookup and model controllers: "no drafts" is measured once for both,
    drafting arms and acceptance stay each one's own."""
    model, lookup = AdaptiveK(max_k=3), AdaptiveK(max_k=3)
    lookup.share_baseline(model)
    model.observe_cost(1, 0, 1.0)
    lookup.observe_cost(1, 2, 1.2)
    assert lookup.cost(1, 0) == model.cost(1, 0) == 1.0
    assert lookup.cost(1, 2) == 1.2 and model.cost(1, 2) is None
    # cheap, well-accepted lookup drafts fully; a dear, rarely right model switches off
    drive(lookup, 1, lambda b, k: 1.0 + 0.1 * k, accept_len=3, steps=300)
    chosen = drive(model, 1, lambda b, k: 1.0 + 0.4 * k, accept_len=0, steps=300)
    assert lookup.choose(1) == 3 and chosen[-100:].count(0) >= 90


def test_adaptive_weighs_the_step_when_only_some_of_the_batch_drafts():
    """Lookup drafts only for the requests whose text has a match: drafting for 2 of 8 must
    pay with what those 2 gain in the step, where the other 6 make one token each (a head's
    drafting and the verify step cost about the same either way)."""
    def run(outcomes: list[int]) -> list[int]:
        adaptive, ids, chosen = AdaptiveK(max_k=3), ["a", "b"], []
        for step in range(300):
            k = adaptive.choose(8, ids)
            chosen.append(k)
            for rid in ids:
                adaptive.observe_acceptance(k, min(k, outcomes[step % len(outcomes)]), rid)
            # 8 sequences; drafting: a fixed 5% (the proposer) + 25% per draft, for 2 of 8
            adaptive.observe_cost(8, k, 8 * (1.05 + 0.25 * k * 2 / 8) if k else 8.0)
        return chosen
    # half their drafts accepted: 1.88 tokens each at k = 3, 1.52x what a plain step makes
    # for them, but the step makes 1.22x for 1.24x the time
    assert run([0, 0, 0, 0, 1, 1, 2, 3])[-100:].count(0) >= 90
    # all accepted: the step makes 1.75x for 1.24x the time
    assert run([3])[-100:].count(3) >= 90


def steps_until_off(adaptive: AdaptiveK, ids: list[str], judge_by_request: bool) -> int:
    """Steps until a batch of new requests whose drafts are never accepted stops drafting."""
    cost = lambda b, k: b * (1 + 0.2 * k)  # noqa: E731  compute-bound batch
    for step in range(1, 500):
        k = adaptive.choose(len(ids), ids if judge_by_request else ())
        if k == 0:
            return step
        for rid in ids:
            adaptive.observe_acceptance(k, 0, rid)
        adaptive.observe_cost(len(ids), k, cost(len(ids), k))
    return 500


def test_adaptive_judges_new_traffic_by_its_own_acceptance():
    """After a long run of traffic whose drafts were always accepted, a batch of requests
    whose drafts never are stops drafting after a few of its own verifications, where the
    global estimate (fading by 0.995 per verification) would take several times as many."""
    def trained() -> AdaptiveK:
        adaptive = AdaptiveK(max_k=3)
        drive(adaptive, 8, lambda b, k: b * (1 + 0.2 * k), accept_len=3, steps=300)
        return adaptive
    ids = [f"new-{i}" for i in range(8)]
    own, overall = steps_until_off(trained(), ids, True), steps_until_off(trained(), ids, False)
    assert own <= 8 and overall >= 4 * own, (own, overall)


def test_adaptive_request_records_start_from_the_global_estimate_and_fade_back():
    adaptive = AdaptiveK(max_k=3)
    for _ in range(200):
        adaptive.observe_acceptance(3, 3)
    overall = adaptive.acceptance(1)
    assert overall > 0.95 and adaptive.acceptance(1, "fresh") == overall
    for _ in range(4):
        adaptive.observe_acceptance(3, 0, "unlucky")
    assert adaptive.acceptance(1, "unlucky") < 0.6  # own misses count as much as the prior
    assert adaptive.expected_tokens(3, ["unlucky"]) < adaptive.expected_tokens(3) - 1
    mixed = adaptive.expected_tokens(3, ["unlucky", "fresh"])
    assert adaptive.expected_tokens(3, ["unlucky"]) < mixed < adaptive.expected_tokens(3)
    # a request left without drafts drifts back toward the global estimate, so it is retried
    for _ in range(3):
        for k in range(4):
            adaptive.observe_cost(1, k, 1.0 + 0.6 * k)
    assert adaptive.choose(1, ["unlucky"]) == 0
    before = adaptive.acceptance(1, "unlucky")
    for _ in range(20):
        adaptive.choose(1, ["unlucky"])
    assert before < adaptive.acceptance(1, "unlucky") < adaptive.acceptance(1)
    adaptive.forget(["unlucky"])
    assert adaptive.acceptance(1, "unlucky") == adaptive.acceptance(1)


def test_adaptive_off_always_asks_for_k_and_caps_batch():
    assert AdaptiveK(max_k=3, enabled=False).choose(64) == 3
    capped = AdaptiveK(max_k=3, max_batch_size=4)
    assert capped.choose(5) == 0 and capped.choose(4) == 0  # the baseline is tried first
    for _ in range(3):
        capped.observe_cost(4, 0, 1.0)
    assert capped.choose(5) == 0 and capped.choose(4) == 3


def test_adaptive_costs_are_relative_to_the_baseline_of_their_time():
    """A drafting arm measured while the machine was quiet must not look cheap against a
    baseline re-measured while it is busy: drafting steps are kept as ratios to the
    baseline's cost when they ran."""
    adaptive = AdaptiveK(max_k=1)
    for _ in range(9):
        adaptive.observe_cost(8, 0, 8 * 1.0)
    for _ in range(3):  # quiet: a 1-draft step costs 1.6 plain ones
        adaptive.observe_cost(8, 1, 8 * 1.6)
    assert adaptive.cost(8, 1) == pytest.approx(1.6)
    for _ in range(9):  # busy: every step takes twice as long, and only k = 0 is measured
        adaptive.observe_cost(8, 0, 8 * 2.0)
    assert adaptive.cost(8, 1) == pytest.approx(3.2)
    for _ in range(20):  # drafts accepted 4 times in 10: 1.4 tokens for 1.6x the cost
        adaptive.observe_acceptance(1, 1)
        adaptive.observe_acceptance(1, 1)
        for _ in range(3):
            adaptive.observe_acceptance(1, 0)
    assert adaptive._best(8, ()) == 0


def test_tree_choice_keeps_the_shape_that_makes_more_tokens_per_cost():
    """Each shape is measured first (trees, then chains); afterwards the one with more tokens
    per unit of cost runs and the other only in probes, and a change of costs turns it."""
    choice = TreeChoice()
    shapes = {True: (2.4, 3.0), False: (1.8, 1.3)}  # tokens, cost: an AVX2 CPU's trees lose

    def run(steps: int) -> list[bool]:
        picks = []
        for _ in range(steps):
            picks.append(tree := choice.choose())
            choice.observe(tree, *shapes[tree])
        return picks

    picks = run(240)
    assert picks[:24] == [True] * 12 + [False] * 12
    # the probes only, ever rarer while chains stay best: after 12, 24, then 48 steps
    assert [i - 24 for i, tree in enumerate(picks) if tree and i >= 24] == [11, 35, 83, 131,
                                                                              179]
    shapes[True] = (2.4, 1.4)  # trees get cheap (a quieter machine): they take over
    picks = run(1000)
    assert picks[-96:].count(False) == 2  # chains in the probes only
    assert choice.rate(True) == pytest.approx(2.4 / 1.4, rel=0.05)


def speculator_dir(path, kind: str):
    """A directory that names a speculator: a kiln head (speculator.json) or a draft
    checkpoint (an HF config.json); nothing in it is loaded."""
    path.mkdir(parents=True)
    if kind == "head":
        (path / "speculator.json").write_text(json.dumps({"kind": "head"}))
    else:
        (path / "config.json").write_text("{}")
    return path


def test_speculator_names_resolve(tmp_path):
    assert resolve_speculative_config(None) is None
    assert resolve_speculative_config("ngram").method == "ngram"
    head = speculator_dir(tmp_path / "h", "head")
    cfg = resolve_speculative_config(str(head), SpeculativeConfig(num_speculative_tokens=5))
    assert (cfg.method, cfg.model, cfg.num_speculative_tokens) == ("head", str(head), 5)
    draft = speculator_dir(tmp_path / "d", "draft")
    assert resolve_speculative_config(str(draft)).method == "draft"
    with pytest.raises(ValueError, match="train-speculator --preset"):
        resolve_speculative_config("no-such-preset")
    with pytest.raises(ValueError, match="needs a model"):
        SpeculativeConfig(method="head")


def test_a_preset_trained_here_wins_over_the_shipped_one(tmp_path, monkeypatch):
    import kiln.speculative.resolve as resolve

    shipped, home = tmp_path / "shipped" / "code-head", tmp_path / "home" / "speculators"
    shipped.mkdir(parents=True)
    (shipped / "speculator.json").write_text(json.dumps({"kind": "head"}))
    monkeypatch.setattr(resolve, "SHIPPED", shipped.parent)
    monkeypatch.setenv("KILN_HOME", str(tmp_path / "home"))
    assert resolve_speculative_config("code-head").model == str(shipped)
    (home / "code-head").mkdir(parents=True)
    (home / "code-head" / "speculator.json").write_text(json.dumps({"kind": "head"}))
    assert resolve_speculative_config("code-head").model == str(home / "code-head")
    with pytest.raises(ValueError, match="train-speculator --preset prose-head"):
        resolve_speculative_config("prose-head")


def test_serve_flags_carry_ngram_first_speculator_int8_and_adaptive(tmp_path):
    from kiln.cli import build_parser
    from kiln.serve.cli import engine_config

    argv = ["serve", "--speculator", "ngram", "--num-speculative-tokens", "4"]
    spec = engine_config(build_parser(argv).parse_args(argv), 1).speculative
    assert (spec.method, spec.num_speculative_tokens, spec.ngram_first,
            spec.speculator_int8) == ("ngram", 4, False, True)
    head = speculator_dir(tmp_path / "h", "head")
    argv[2] = str(head)
    argv.append("--no-ngram-first")
    assert not engine_config(build_parser(argv).parse_args(argv), 1).speculative.ngram_first
    argv[-1] = "--ngram-first"
    assert engine_config(build_parser(argv).parse_args(argv), 1).speculative.ngram_first
    argv.append("--speculative-tree-width=1")
    argv.append("--no-speculator-int8")
    assert not engine_config(build_parser(argv).parse_args(argv), 1).speculative.speculator_int8
    assert engine_config(build_parser(argv).parse_args(argv), 1).speculative.tree_width == 1
    argv += ["--speculative-tree-width", "3", "--speculative-tree-max-batch", "4",
             "--speculative-tree-size", "7"]
    spec = engine_config(build_parser(argv).parse_args(argv), 1).speculative
    assert (spec.tree_width, spec.tree_max_batch, spec.tree_size) == (3, 4, 7)
    assert spec.adaptive
    argv.append("--no-speculative-adaptive")
    assert not engine_config(build_parser(argv).parse_args(argv), 1).speculative.adaptive
    with pytest.raises(ValueError, match=r"tree_width must be in \[1, 8\], got 9"):
        SpeculativeConfig(tree_width=9)
    assert (SpeculativeConfig().resolved().tree_size == DEFAULT_TREE_DRAFTS == 15
            and SpeculativeConfig(tree_size=31).resolved().tree_size == 31)
    with pytest.raises(ValueError, match=r"tree_size must be in \[1, 31\], got 32"):
        SpeculativeConfig(tree_size=32)
    argv += ["--speculative-tree-min-prob", "0.02"]
    assert engine_config(build_parser(argv).parse_args(argv), 1).speculative.tree_min_prob == 0.02
    assert SpeculativeConfig().tree_min_prob is None  # the method's default
    for bad in (1.0, -0.5):
        with pytest.raises(ValueError, match=rf"tree_min_prob must be in \[0, 1\), got {bad}"):
            SpeculativeConfig(tree_min_prob=bad)
    argv = ["serve"]
    assert engine_config(build_parser(argv).parse_args(argv), 1).speculative is None


def test_a_head_drafts_trees_with_lookup_joined_unless_told_otherwise(tmp_path):
    """A head's defaults are the shape measured fastest at batch 1 (3 wide, up to 12 drafts
    of path probability >= 0.03, lookup's continuation in the tree); lookup and draft models
    keep chains (no floor); any flag or field given explicitly wins."""
    from kiln.cli import build_parser
    from kiln.serve.cli import engine_config

    head = speculator_dir(tmp_path / "h", "head")
    draft = speculator_dir(tmp_path / "d", "draft")

    def shape(*flags):
        argv = ["serve", *flags]
        spec = engine_config(build_parser(argv).parse_args(argv), 1).speculative
        return spec.ngram_first, spec.tree_width, spec.tree_size, spec.tree_max_batch

    def floor(*flags):
        argv = ["serve", *flags]
        return engine_config(build_parser(argv).parse_args(argv), 1).speculative.tree_min_prob

    assert shape("--speculator", str(head)) == (True, HEAD_TREE_WIDTH, HEAD_TREE_DRAFTS, 1)
    assert floor("--speculator", str(head)) == HEAD_TREE_MIN_PROB == 0.03
    assert floor("--speculator", str(draft)) == floor("--speculator", "ngram") == 0.0
    assert floor("--speculator", str(head), "--speculative-tree-min-prob", "0") == 0.0
    assert shape("--speculator", str(draft)) == (False, 1, DEFAULT_TREE_DRAFTS, 1)
    assert shape("--speculator", "ngram") == (False, 1, DEFAULT_TREE_DRAFTS, 1)
    assert shape("--speculator", str(head), "--no-ngram-first",
                 "--speculative-tree-width", "1") == (False, 1, HEAD_TREE_DRAFTS, 1)
    assert shape("--speculator", str(draft), "--ngram-first",
                 "--speculative-tree-size", "5") == (True, 1, 5, 1)
    # the same through LLM(speculator=..., speculative_config=...) and the dataclass itself
    cfg = resolve_speculative_config(str(head), SpeculativeConfig(tree_width=2))
    assert (cfg.ngram_first, cfg.tree_width, cfg.tree_size) == (True, 2, HEAD_TREE_DRAFTS)
    unresolved = SpeculativeConfig(method="head", model=str(head))
    assert unresolved.tree_width is None and unresolved.resolved().tree_width == HEAD_TREE_WIDTH
    assert unresolved.resolved().resolved() == unresolved.resolved()


def test_ngram_tree_merges_continuations_of_several_occurrences():
    tokens = np.array([1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 4, 5, 1, 2, 3])
    chain, n = ngram_match(tokens, 3, 1, 4)
    tree, matched = ngram_tree(tokens, 3, 1, 4, width=1)
    assert (tree.token_ids, tree.parents, matched) == (chain, None, n)  # width 1: the chain
    tree, _ = ngram_tree(tokens, 3, 1, 4, width=4)
    # the chain first ("1 2 3" last followed by 7 8 1), then the other occurrence's 9 1 2
    assert tree == Draft([7, 8, 1, 9, 1, 2], None, [-1, 0, 1, -1, 3, 4])
    assert tree.main_chain() == Draft(chain)
    # "2" occurs three times before: 3 7 (the latest), then 4 5, then 3 9 (shares its 3)
    tokens = np.array([2, 3, 9, 2, 4, 5, 2, 3, 7, 2])
    assert ngram_tree(tokens, 2, 1, 4, width=3)[0] == Draft([3, 7, 4, 5, 9], None,
                                                            [-1, 0, -1, 2, 0])
    assert ngram_tree(tokens, 2, 1, 4, width=2)[0] == Draft([3, 7, 4, 5], None, [-1, 0, -1, 2])
    assert ngram_tree(tokens, 2, 1, 4, width=3, size=4)[0] == Draft([3, 7, 4, 5], None,
                                                                    [-1, 0, -1, 2])


def test_draft_limits_keep_a_tree_closed_under_parents():
    tree = Draft([7, 8, 1, 9, 1, 2], None, [-1, 0, 1, -1, 3, 4])
    assert tree.limit(2, 15) == Draft([7, 8, 9, 1], None, [-1, 0, -1, 2])
    assert tree.limit(3, 4) == Draft([7, 8, 1, 9], None, [-1, 0, 1, -1])
    assert tree.limit(3, 3) == Draft([7, 8, 1])  # what is left is a chain
    assert Draft([5, 6, 7]).limit(2, 15) == Draft([5, 6])


def test_draft_trie_merges_trees_by_common_prefix():
    trie = DraftTrie(15)
    trie.add_draft(Draft([7, 8, 1]))  # lookup's chain first
    # a head tree: 7 -> {8 -> 2, 5}, 9 -> 1: its 7 8 is lookup's, the rest is new
    trie.add_draft(Draft([7, 9, 8, 5, 1, 2], None, [-1, -1, 0, 0, 1, 2]))
    assert trie.draft() == Draft([7, 8, 1, 9, 5, 1, 2], None, [-1, 0, 1, -1, 0, 3, 1])
    small = DraftTrie(4)
    small.add_draft(Draft([7, 8, 1]))
    small.add_draft(Draft([7, 9, 8, 5], None, [-1, -1, 0, 0]))  # full after 9: 8 and 5 wait
    assert small.draft() == Draft([7, 8, 1, 9], None, [-1, 0, 1, -1])


def test_head_tree_keeps_its_likeliest_nodes_likeliest_first():
    from kiln.speculative.head.proposer import _best_nodes

    # (log-likelihood, depth, token, parent) as the beam search expands them
    nodes = [(-0.1, 1, 10, -1), (-2.0, 1, 11, -1),  # depth 1
             (-0.3, 2, 20, 0), (-1.5, 2, 21, 0), (-2.5, 2, 22, 1), (-3.0, 2, 23, 1),
             (-0.3, 3, 30, 2), (-0.9, 3, 31, 2), (-1.6, 3, 32, 3), (-4.0, 3, 33, 3)]
    # the 5 likeliest: 10, then 20 and its child 30 (a tie: the shallower first), 31, 21
    assert _best_nodes(nodes, 5) == Draft([10, 20, 30, 31, 21], None, [-1, 0, 1, 1, 0])
    assert _best_nodes(nodes, 3) == Draft([10, 20, 30], None, [-1, 0, 1])


def test_a_tree_by_probability_keeps_the_nodes_that_clear_the_floor():
    """tree_min_prob: the nodes whose path probability reaches the floor (at least one, at
    most the tree size), whatever the beam's width; without a floor the k * width likeliest."""
    import math

    from kiln.speculative.head.proposer import _best_nodes, tree_node_count

    nodes = [(-0.1, 1, 10, -1), (-2.0, 1, 11, -1),
             (-0.3, 2, 20, 0), (-1.5, 2, 21, 0), (-2.5, 2, 22, 1), (-3.0, 2, 23, 1),
             (-0.3, 3, 30, 2), (-0.9, 3, 31, 2), (-1.6, 3, 32, 3), (-4.0, 3, 33, 3)]
    assert tree_node_count(nodes, 6, None, 12) == 6
    assert tree_node_count(nodes, 6, math.exp(-1.0), 12) == 4  # 10, 20, 30, 31
    assert tree_node_count(nodes, 6, math.exp(-2.05), 12) == 7  # and 21, 11 (-2.0), 32
    assert tree_node_count(nodes, 6, math.exp(-2.05), 5) == 5  # the tree size caps it
    assert tree_node_count(nodes, 6, 0.99, 12) == 1  # the likeliest draft at least
    assert tree_node_count(nodes, 6, 1e-3, 31) == len(nodes)
    kept = _best_nodes(nodes, tree_node_count(nodes, 6, math.exp(-1.0), 12))
    assert kept == Draft([10, 20, 30, 31], None, [-1, 0, 1, 1])


def test_a_draining_batch_drafts_only_where_its_slowest_request_gains():
    """Once no request waits for a slot, the batch lasts as long as its slowest request:
    drafts that race the others ahead free slots nobody fills and make its steps dearer."""
    def run(outcomes: dict[str, int], left: dict[str, int] | None) -> list[int]:
        adaptive, chosen = AdaptiveK(max_k=3), []
        for _ in range(300):
            k = adaptive.choose(8, list(outcomes), left)
            chosen.append(k)
            for rid, accepted in outcomes.items():
                adaptive.observe_acceptance(k, min(k, accepted), rid)
            adaptive.observe_cost(8, k, 8 * (1 + 0.15 * k))
        return chosen
    rids = [f"r{i}" for i in range(8)]
    mixed = {rid: 3 if i < 6 else 0 for i, rid in enumerate(rids)}  # 2 never accepted
    # under load (slots refill) the step's tokens decide: 3.25 per sequence for 1.45x
    assert run(mixed, None)[-100:].count(3) >= 90
    # draining with as many tokens left each: the 2 that never gain decide the batch's end
    # (they are retried now and then: their own misses fade toward the others' record)
    assert run(mixed, dict.fromkeys(rids, 40))[-100:].count(0) >= 60
    # ... unless they are nearly done: the others are the slowest then
    assert run(mixed, {rid: 40 if i < 6 else 4 for i, rid in enumerate(rids)})[-100:].count(3) >= 90
    # every request gains: drafting shortens the batch
    assert run(dict.fromkeys(rids, 3), dict.fromkeys(rids, 40))[-100:].count(3) >= 90


def test_the_speculator_counts_tokens_left_by_max_tokens_or_the_context():
    request = SimpleNamespace(num_output_tokens=20, num_tokens=30,
                              params=SimpleNamespace(max_tokens=48))
    assert tokens_left(request, max_model_len=100) == 28
    request.params.max_tokens = None
    assert tokens_left(request, max_model_len=100) == 70


def test_a_vllm_style_speculative_config_dict_maps_onto_kiln(tmp_path):
    """vLLM's `speculative_config` keys (method names, prompt_lookup_*,
    disable_by_batch_size) land on kiln's fields, kiln's own fields pass as they are, a
    model's kind is checked against the method, and every mistake is a ValueError naming
    the key."""
    from kiln.speculative.resolve import speculative_config_from_dict as from_dict

    head = speculator_dir(tmp_path / "h", "head")
    draft = speculator_dir(tmp_path / "d", "draft")
    spec = from_dict({"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2,
                      "prompt_lookup_max": 6, "disable_by_batch_size": 8})
    assert (spec.method, spec.num_speculative_tokens, spec.ngram_min, spec.ngram_max,
            spec.max_batch_size, spec.tree_width) == ("ngram", 5, 2, 6, 8, 1)
    assert (from_dict({"method": "ngram", "prompt_lookup_min": 6}).ngram_max,
            from_dict({"method": "ngram", "prompt_lookup_max": 2}).ngram_min) == (6, 1)
    for method in ("eagle", "eagle3", "head", None):
        spec = from_dict({"method": method, "model": str(head), "tree_size": 20,
                          "draft_tensor_parallel_size": 1})
        assert (spec.method, spec.model, spec.tree_size, spec.tree_width, spec.ngram_first) == (
            "head", str(head), 20, HEAD_TREE_WIDTH, True)  # a head's defaults filled in
    assert from_dict({"method": "draft_model", "model": str(draft)}).method == "draft"
    assert from_dict({"model": str(draft), "adaptive": False}).adaptive is False
    assert from_dict({"model": "ngram"}).method == "ngram"
    for bad, message in [
            ({"method": "suffix"}, "method 'suffix' is not one kiln has"),
            ({"method": "ngram", "prompt_lookup_mx": 3}, "unknown key 'prompt_lookup_mx'"),
            ({"method": "ngram", "num_speculative_tokens": "3"},
             "num_speculative_tokens must be int, got '3'"),
            ({"method": "ngram", "adaptive": 1}, "adaptive must be bool, got 1"),
            ({"method": "ngram", "max_batch_size": 4, "disable_by_batch_size": 4},
             "'disable_by_batch_size' and 'max_batch_size' are the same setting"),
            ({"method": "ngram", "model": str(draft)}, "takes no model"),
            ({"method": "eagle", "model": str(draft)}, "wants a kiln head.* is a draft"),
            ({"method": "draft_model", "model": str(head)}, "wants a draft model.* is a head"),
            ({"method": "eagle"}, "needs a 'model'"),
            ({"method": "eagle", "model": "no-such-preset"}, "model: speculator 'no-such-"),
            ({"method": "ngram", "draft_tensor_parallel_size": 2}, "draft_tensor_parallel_size"),
            ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must"),
            ({"method": 3}, "method must be a string"),
            ([("method", "ngram")], "must be a JSON object")]:
        with pytest.raises(ValueError, match=message):
            from_dict(bad)
    with pytest.raises(ValueError, match="name the speculator once"):
        resolve_speculative_config("ngram", {"method": "ngram"})
    assert resolve_speculative_config(None, {"method": "ngram"}).method == "ngram"


def test_serve_takes_a_speculative_config_json_and_flags_override_it(tmp_path, capsys):
    from kiln.cli import build_parser, main
    from kiln.serve.cli import engine_config

    head = speculator_dir(tmp_path / "h", "head")

    def spec(*flags):
        argv = ["serve", *flags]
        return engine_config(build_parser(argv).parse_args(argv), 1).speculative

    s = spec("--speculative-config", json.dumps({"method": "eagle", "model": str(head),
                                                  "num_speculative_tokens": 4,
                                                  "tree_size": 20}))
    assert (s.method, s.model, s.num_speculative_tokens, s.tree_size, s.adaptive) == (
        "head", str(head), 4, 20, True)
    s = spec("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}',
             "--num-speculative-tokens", "2", "--no-speculative-adaptive")
    assert (s.method, s.num_speculative_tokens, s.adaptive) == ("ngram", 2, False)
    # without either flag nothing speculates; the other flags' defaults are the dataclass's
    assert spec("--num-speculative-tokens", "2") is None
    s = spec("--speculator", "ngram")
    assert (s.num_speculative_tokens, s.adaptive, s.tree_max_batch, s.speculator_int8) == (
        3, True, 1, True)
    # mistakes: one line naming what to fix, exit status 2, no traceback
    for flags, message in [
            (["--speculative-config", "{method: ngram}"], "--speculative-config is not JSON"),
            (["--speculative-config", "[1]"], "--speculative-config must be a JSON object"),
            (["--speculative-config", '{"method": "medusa"}'],
             "--speculative-config: method 'medusa' is not one kiln has"),
            (["--speculative-config", '{"method": "ngram"}', "--speculative-tree-size", "40"],
             r"--speculative-config: tree_size must be in \[1, 31\], got 40"),
            (["--speculator", "ngram", "--speculative-tree-min-prob", "2"],
             r"tree_min_prob must be in \[0, 1\), got 2.0"),
            (["--speculator", "ngram", "--speculative-config", '{"method": "ngram"}'],
             "--speculator and --speculative-config both name a speculator")]:
        assert main(["serve", *flags]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("kiln serve: error: ") and "\n" not in err
        assert re.search(message, err), err
