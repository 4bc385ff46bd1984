"""Expert placement, the per-expert load counters and their export, with exact values."""

from __future__ import annotations

import pytest
import torch

from kiln.cluster.messages import ExpertLoadStats
from kiln.cluster.stats import max_over_mean, sum_expert_load
from kiln.config import ParallelConfig
from kiln.models.layers.expert_parallel import (
    ExpertLoad,
    ExpertShard,
    check_placement,
    collect_expert_load,
    place_experts,
)
from kiln.models.layers.experts import FusedExperts
from kiln.models.layers.moe import SparseMoeBlock
from kiln.models.layers.moe_config import MoeShape
from kiln.models.layers.ops import TorchOps
from kiln.models.layers.parallel import TensorParallel
from kiln.serve.metrics import expert_load_metrics
from tests.unit.test_moe_router import per_token_reference, spec


def test_uniform_load_is_round_robin():
    placement = place_experts([1.0] * 8, num_ranks=2)
    assert placement.ranks_of == tuple((e % 2,) for e in range(8))
    assert placement.experts_on(1) == (1, 3, 5, 7)


def test_redundant_copies_go_to_the_hottest_experts_on_the_least_loaded_ranks():
    # expert 0 is hottest (2 copies: 50 per copy), then expert 4 (2 copies: 25 each); the
    # copies are packed so both ranks carry 50 + 25 + 3 * 10 = 105
    load = [100, 10, 10, 10, 50, 10, 10, 10]
    placement = place_experts(load, num_ranks=2, num_redundant=2)
    assert placement.ranks_of == ((0, 1), (0,), (1,), (0,), (0, 1), (1,), (0,), (1,))
    assert len(placement.experts_on(0)) == len(placement.experts_on(1)) == 5
    copies, copy_rank = placement.copy_tables()
    assert copies.tolist() == [2, 1, 1, 1, 2, 1, 1, 1]
    assert copy_rank[:2].tolist() == [[0, 1], [0, 0]]


def test_placement_bad_numbers_are_named():
    with pytest.raises(ValueError, match="7 experts \\+ 0 redundant copies = 7 expert slots, "
                                         "not divisible by tensor_parallel_size 2"):
        check_placement(7, 2, 0)
    with pytest.raises(ValueError, match="num_redundant_experts 10 is more than the 8 copies "
                                         "8 experts can have over 2 ranks"):
        check_placement(8, 2, 10)
    with pytest.raises(ValueError, match="num_redundant_experts 2 needs enable_expert_parallel"):
        ParallelConfig(num_redundant_experts=2)


def hand_routed_block() -> SparseMoeBlock:
    """4 experts, top 2, hidden 4, router weight I: a token's logits are its own values."""
    shape = MoeShape(4, 6, spec(2, True, 4))
    block = SparseMoeBlock(shape, "mlp", lambda prefix: None, torch.float32, TorchOps(),
                           layer=3)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.full(p.shape, 0.1))
        block.gate.weight.copy_(torch.eye(4))
    return block


def test_load_counters_exact():
    block = hand_routed_block()
    x = torch.tensor([[3.0, 2, 0, 0], [0, 0, 3, 2], [3, 0, 2, 0]])  # experts {0,1} {2,3} {0,2}
    block(x)
    block(x[:1])  # a decode step of the first token: {0, 1} again
    load = collect_expert_load([block])
    assert load.layers == (3,)
    assert load.tokens.tolist() == [[3, 2, 2, 1]]
    assert load.expert_imbalance().tolist() == [3 / 2]  # max 3 over mean 8 / 4
    assert load.rank_tokens is None and load.rank_imbalance() is None
    again = ExpertLoad.from_json(load.to_json())
    assert again.layers == (3,) and again.tokens.tolist() == [[3, 2, 2, 1]]


class TwoRanks:
    """The rank/size a sharded module reads (no collective is made in these unit tests)."""

    def __init__(self, rank: int):
        self.rank, self.world_size = rank, 2


def test_owned_pairs_of_two_ranks_sum_to_the_whole():
    """Under expert parallelism with a redundant copy of expert 0, the two ranks' partial
    sums (each over the pairs it owns) add up to one process's output."""
    block = hand_routed_block()
    x = torch.randn(7, 4)
    routing = block.gate(x)
    placement = place_experts([5.0, 1, 1, 1], num_ranks=2, num_redundant=2)
    parts, owned = [], []
    for rank in (0, 1):
        shard = ExpertShard(TensorParallel(TwoRanks(rank)), placement)
        experts = FusedExperts(4, 6, 4, "mlp.experts", lambda prefix: None, torch.float32,
                               TorchOps(), shard)
        for e in shard.held_experts(4):
            experts[e].load_state_dict(block.experts[e].state_dict())
        owners = experts.owners(routing.experts)
        owned.append(owners == rank)
        parts.append(experts(x, routing, owners))
    assert torch.equal(owned[0] ^ owned[1], torch.ones_like(owned[0]))  # each pair once
    torch.testing.assert_close(parts[0] + parts[1],
                               per_token_reference(block.experts, x, routing))


def test_workers_expert_loads_sum_and_export():
    a = ExpertLoadStats([1, 2], [[3, 1], [0, 4]], [[2, 2], [1, 3]])
    b = ExpertLoadStats([1, 2], [[1, 1], [2, 2]], [[1, 1], [2, 2]])
    total = sum_expert_load([a, None, b])
    assert total.tokens == [[4, 2], [2, 6]] and total.rank_tokens == [[3, 3], [3, 5]]
    assert max_over_mean([4, 2]) == 4 / 3 and max_over_mean([0, 0]) == 0.0
    samples = {(m.name, tuple(s.labels.items())): s.value
               for m in expert_load_metrics(total) for s in m.samples}
    assert samples[("kiln:moe_expert_tokens", (("layer", "2"), ("expert", "1")))] == 6
    assert samples[("kiln:moe_expert_imbalance", (("layer", "2"),))] == 6 / 4
    assert samples[("kiln:moe_rank_imbalance", (("layer", "1"),))] == 1.0

