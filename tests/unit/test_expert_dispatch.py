"""The all-to-all exchange's bookkeeping (kiln.distributed.expert_dispatch), exact values; the
exchange over real groups is tests/distributed/test_all_to_all.py."""

from __future__ import annotations

import pytest
import torch

from kiln.distributed.expert_dispatch import (
    StepCounts,
    count_table,
    pack_rows,
    plan_dispatch,
    unpack_rows,
)

# 3 tokens, k = 2, over 3 ranks: token 0 -> ranks 2, 0; token 1 -> 1, 2; token 2 -> 0, 0
OWNERS = torch.tensor([[2, 0], [1, 2], [0, 0]])
EXPERTS = torch.tensor([[5, 0], [4, 2], [3, 6]])


def test_the_plan_sends_each_token_once_to_each_rank_computing_its_pairs():
    plan = plan_dispatch(OWNERS, EXPERTS, 3, 8)
    # rank 0 computes pairs of tokens 0 and 2, rank 1 of token 1, rank 2 of tokens 0 and 1
    assert plan.dest.tolist() == [0, 0, 1, 2, 2]
    assert plan.token.tolist() == [0, 2, 1, 0, 1]
    assert plan.send_counts.tolist() == [2, 1, 2]
    assert plan.expert_counts.tolist() == [1, 0, 1, 1, 1, 1, 1, 0]
    assert plan.rank_pairs.tolist() == [3, 1, 2]


def test_the_counts_table_holds_this_ranks_row_only():
    table = count_table(plan_dispatch(OWNERS, EXPERTS, 3, 8), 1)
    assert table.dtype == torch.float32 and table.shape == (3, 14)
    assert table[1].tolist() == [2, 1, 2, 3, 1, 2, 1, 0, 1, 1, 1, 1, 1, 0]
    assert table[0].abs().sum() == table[2].abs().sum() == 0


def test_step_counts_read_sends_receives_and_counters():
    # 2 ranks, 2 experts: rows sent to each rank, pairs each rank computes, pairs per expert
    counts = StepCounts(torch.tensor([[1, 2, 2, 1, 1, 2], [0, 3, 1, 2, 2, 1]]))
    assert counts.sends(0) == [1, 2] and counts.sends(1) == [0, 3]
    assert counts.receives(0) == [1, 0] and counts.receives(1) == [2, 3]
    assert counts.rank_tokens().tolist() == [3, 3]
    assert counts.expert_tokens().tolist() == [3, 3]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_routing_rides_the_rows_bit_for_bit(dtype):
    """Ids a bf16 value could not hold (257, 1023) and fp32 weights arrive as sent: their
    bits, not values; -1 (a pair another rank computes) marks the pair not owned."""
    rows = torch.randn(4, 6).to(dtype)
    ids = torch.tensor([[0, -1], [257, 3], [-1, 1023], [3, 3]])
    weights = torch.rand(4, 2)
    packed = pack_rows(rows, ids, weights)
    assert packed.shape == (4, 6 + (4 if dtype == torch.float32 else 8))
    got = unpack_rows(packed, 2)
    assert torch.equal(got.rows, rows) and torch.equal(got.weights, weights)
    assert got.experts.tolist() == [[0, 0], [257, 3], [0, 1023], [3, 3]]
    assert got.owned.tolist() == [[True, False], [True, True], [False, True], [True, True]]
    empty = unpack_rows(pack_rows(rows[:0], ids[:0], weights[:0]), 2)
    assert empty.rows.shape == (0, 6) and empty.experts.shape == (0, 2)
