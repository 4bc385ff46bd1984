"""The all-to-all expert exchange (`all2all_backend="alltoall"`) over real rank processes.

Data-parallel attention with expert parallelism over 2 rank processes, fp32: each rank routes
its own tokens and sends each routed pair only to the rank holding its expert, which sends the
output back. The batch of tests/distributed/test_data_parallel.py (steps where both ranks run
requests, and steps where either has none) must give one process's greedy tokens, prompt
logprobs and expert counts for Qwen3-MoE and DeepSeek-V3 (MLA, a dense first layer, shared
experts), with and without redundant expert copies. The exchange itself runs over two gloo
groups (gloo and shared-memory all-reduce) with exact values; bad combinations fail naming
the parameter.
"""

from __future__ import annotations

import pytest
import torch

from kiln import LLM
from kiln.config import ParallelConfig
from kiln.distributed.communicator import ShmCommunicator, shm_available
from kiln.distributed.expert_dispatch import ExpertDispatch, plan_dispatch
from kiln.runner.data_parallel import DataParallelAttention
from tests.distributed.test_communicator import run_ranks
from tests.distributed.test_data_parallel import (
    DP,
    MAKERS,
    PARAMS,
    PROMPTS,
    record_rank_occupancy,
)
from tests.distributed.test_tensor_parallel import SETTINGS, assert_same
from tests.parity.test_moe_parity import make_tiny_moe

ALL_TO_ALL = dict(DP, all2all_backend="alltoall")


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """(family, redundant copies, all-reduce) -> (one-process engine, all-to-all engine):
    the all-to-all through shared memory where the group's all-reduce is (auto), else gloo."""
    ones: dict[str, LLM] = {}
    made: dict[tuple[str, int, str], LLM] = {}

    def get(family: str, redundant: int, all_reduce: str = "auto") -> tuple[LLM, LLM]:
        if family not in ones:
            ones[family] = LLM(MAKERS[family](tmp_path_factory.mktemp(family)), **SETTINGS)
        key = family, redundant, all_reduce
        if key not in made:
            made[key] = LLM(ones[family].engine.model_path, **SETTINGS, **ALL_TO_ALL,
                            num_redundant_experts=redundant, all_reduce=all_reduce)
        return ones[family], made[key]

    yield get
    for two in made.values():
        two.close()


@pytest.mark.parametrize("family, redundant, all_reduce", [
    ("qwen3_moe", 0, "auto"), ("qwen3_moe", 2, "auto"), ("deepseek_v3", 0, "auto"),
    ("deepseek_v3", 2, "auto"), ("qwen3_moe", 2, "gloo")])
def test_all_to_all_ranks_match_one_process(engines, family, redundant, all_reduce):
    one, two = engines(family, redundant, all_reduce)
    runner = two.engine.runner
    assert isinstance(runner.data_parallel, DataParallelAttention)
    assert runner.data_parallel.exchange.dispatch is not None
    shm = isinstance(runner.data_parallel.exchange.comm, ShmCommunicator)
    assert not shm if all_reduce == "gloo" else shm == shm_available()
    occupancy = record_rank_occupancy(two)
    outputs = two.generate(PROMPTS, PARAMS, use_tqdm=False)
    before = one.expert_load().tokens  # (one process's engine serves both redundancies)
    assert_same(one.generate(PROMPTS, PARAMS, use_tqdm=False), outputs)
    assert any(a and b for a, b in occupancy)  # both ranks ran requests in one step
    assert any(a == 0 < b for a, b in occupancy)  # rank 0 had no tokens in a step
    assert any(b == 0 < a for a, b in occupancy)  # rank 1 had no tokens in a step
    # each rank routed only its own tokens; the exchanged counts add up to one process's
    load = two.expert_load()
    assert load.tokens.tolist() == (one.expert_load().tokens - before).tolist()
    assert load.rank_tokens.sum(dim=1).tolist() == load.tokens.sum(dim=1).tolist()
    if redundant:  # both copies of the hottest experts computed some pairs
        assert (load.rank_tokens > 0).all()


def test_a_gated_shared_expert_of_any_width(tmp_path):
    """Qwen2-MoE (a sigmoid-gated shared expert, one dense layer) whose shared expert is 33
    wide: the all-gather exchange splits it by columns over the 2 ranks and refuses, the
    all-to-all one keeps it whole and matches one process."""
    path = make_tiny_moe(tmp_path, "qwen2_moe", shared_expert_intermediate_size=33)
    with pytest.raises(ValueError, match="data_parallel_size 2 does not divide the shared "
                                         "experts' intermediate size 33"):
        LLM(path, **SETTINGS, **DP)
    one, two = LLM(path, **SETTINGS), LLM(path, **SETTINGS, **ALL_TO_ALL)
    try:
        assert_same(one.generate(PROMPTS, PARAMS, use_tqdm=False),
                    two.generate(PROMPTS, PARAMS, use_tqdm=False))
    finally:
        two.close()


def test_shared_experts_are_whole_on_each_rank(engines):
    """No all-reduce closes the block: each rank computes its own tokens' shared experts,
    so they are not split by columns (as they are under the all-gather exchange)."""
    one, two = engines("deepseek_v3", 0)
    block = next(m for m in two.engine.runner.model.modules() if hasattr(m, "shared_mlp")
                 and m.shared_mlp() is not None)
    ref = next(m for m in one.engine.runner.model.modules() if hasattr(m, "shared_mlp")
               and m.shared_mlp() is not None)
    assert block.shared_mlp().down_proj.weight.shape == ref.shared_mlp().down_proj.weight.shape


def fake_experts(got) -> torch.Tensor:
    """A stand-in for the experts, exact in fp32: sum over the pairs computed here of
    weight * (row + expert id)."""
    terms = got.weights.unsqueeze(2) * (got.rows.unsqueeze(1) + got.experts.unsqueeze(2))
    return (terms * got.owned.unsqueeze(2)).sum(dim=1)


def run_dispatch(group, x, experts):
    """One block's exchange on this rank (expert e on rank e mod 2, weights e + 1)."""
    dispatch = ExpertDispatch(group.comm)
    owners, weights = experts % 2, experts.float() + 1
    plan = plan_dispatch(owners, experts, 2, 4)
    counts = dispatch.exchange_counts(plan)
    got = dispatch.dispatch(x, experts, weights, owners, plan, counts)
    y = dispatch.combine(fake_experts(got), plan, counts, x.shape[0])
    expected = (weights.unsqueeze(2) * (x.unsqueeze(1) + experts.unsqueeze(2))).sum(dim=1)
    return plan, counts, got, y, expected, dispatch.sent_bytes


@pytest.mark.parametrize("all_reduce", ["gloo", "shm"])
def test_dispatch_and_combine_move_exact_rows(all_reduce):
    """Rank 0 routes 3 tokens, rank 1 one token (k = 2, 4 experts, expert e on rank e mod 2):
    each token goes once to each rank computing any of its pairs, with its routing; each
    rank receives exactly those rows, in source-rank order; the combine gives every token
    the sum over all its pairs, wherever they were computed."""
    experts = [torch.tensor([[0, 1], [3, 2], [1, 3]]), torch.tensor([[2, 0]])]
    hidden = [torch.arange(3 * 4, dtype=torch.float32).view(3, 4),
              100 + torch.arange(4, dtype=torch.float32).view(1, 4)]
    (plan0, counts, got0, y0, want0, sent0), (plan1, counts1, got1, y1, want1, sent1) = \
        run_ranks(lambda group: run_dispatch(group, hidden[group.rank], experts[group.rank]),
                  all_reduce)
    # rank 0's tokens 0, 1 have pairs on both ranks, token 2 on rank 1 only
    assert plan0.dest.tolist() == [0, 0, 1, 1, 1] and plan0.token.tolist() == [0, 1, 0, 1, 2]
    assert plan1.dest.tolist() == [0] and plan1.token.tolist() == [0]
    # rows sent to each rank, pairs each rank computes, pairs per expert; the same on both
    assert counts.table.tolist() == counts1.table.tolist() == [[2, 3, 2, 4, 1, 2, 1, 2],
                                                               [1, 0, 2, 0, 1, 0, 1, 0]]
    assert counts.rank_tokens().tolist() == [4, 4]
    assert counts.expert_tokens().tolist() == [2, 2, 2, 2]
    assert got0.rows[:, 0].tolist() == [0.0, 4.0, 100.0]  # its own tokens 0, 1; rank 1's 0
    assert got0.owned.tolist() == [[True, False], [False, True], [True, True]]
    assert got0.experts.tolist() == [[0, 0], [0, 2], [2, 0]]  # (not owned: 0)
    assert got1.rows[:, 0].tolist() == [0.0, 4.0, 8.0]  # rank 0's three tokens
    assert got1.owned.tolist() == [[False, True], [True, False], [True, True]]
    assert got1.experts.tolist() == [[0, 1], [3, 0], [1, 3]]
    assert torch.equal(y0, want0) and torch.equal(y1, want1)
    # bytes for the other rank: a table row, the rows out (4 values + 2 ids + 2 weights,
    # fp32), the partial sums back (4 values)
    assert sent0 == 8 * 4 + 3 * 8 * 4 + 1 * 4 * 4
    assert sent1 == 8 * 4 + 1 * 8 * 4 + 3 * 4 * 4


@pytest.mark.parametrize("all_reduce", ["gloo", "shm"])
def test_a_rank_with_no_tokens_still_meets_every_exchange(all_reduce):
    experts = [torch.empty(0, 2, dtype=torch.int64), torch.tensor([[1, 0]])]
    (plan0, _, got0, y0, _, _), (_, _, got1, y1, want1, _) = run_ranks(
        lambda group: run_dispatch(group, torch.full((group.rank, 3), 7.0),
                                   experts[group.rank]), all_reduce)
    assert plan0.token.tolist() == [] and got0.owned.tolist() == [[False, True]]
    assert got1.owned.tolist() == [[True, False]]
    assert y0.shape == (0, 3) and torch.equal(y1, want1)


def test_bad_combinations_name_the_parameter(tmp_path):
    with pytest.raises(ValueError, match="all2all_backend 'alltoall' .* needs "
                                         "data_parallel_size > 1 and enable_expert_parallel "
                                         "\\(got data_parallel_size 1"):
        ParallelConfig(all2all_backend="alltoall", enable_expert_parallel=True)
    with pytest.raises(ValueError, match="got data_parallel_size 2, enable_expert_parallel "
                                         "False"):
        ParallelConfig(all2all_backend="alltoall", data_parallel_size=2)
    with pytest.raises(ValueError, match="all2all_backend"):
        ParallelConfig(all2all_backend="deepep", data_parallel_size=2,
                       enable_expert_parallel=True)
    with pytest.raises(ValueError, match="all2all_backend 'alltoall'"):
        LLM(MAKERS["qwen3_moe"](tmp_path), **SETTINGS, tensor_parallel_size=2,
            enable_expert_parallel=True, all2all_backend="alltoall")
