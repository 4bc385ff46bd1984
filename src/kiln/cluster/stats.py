"""Figures the gateway keeps about its cluster (exported by kiln.serve.metrics)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kiln.cluster.messages import ExpertLoadStats, WorkerStats
from kiln.cluster.router import Decision

if TYPE_CHECKING:
    from torch import nn

HIT_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256)  # hit blocks per routing decision


@dataclass
class ClusterCounters:
    """Cumulative counts since the gateway started (exported by serve/metrics.py)."""

    decisions: dict[str, int] = field(default_factory=lambda: defaultdict(int))  # every leg
    hit_blocks: list[int] = field(default_factory=lambda: [0] * (len(HIT_BUCKETS) + 1))
    hit_blocks_sum: int = 0
    prompt_blocks_sum: int = 0
    handoffs: int = 0  # prefill -> decode handoffs
    retries: int = 0  # resent unchanged after a lost worker
    migrations: int = 0  # resumed mid-stream after a lost worker
    lost: int = 0  # failed because their worker was lost

    def record(self, decision: Decision) -> None:
        self.decisions[decision.chosen] += 1
        hits = decision.hit_blocks
        self.hit_blocks_sum += hits
        self.prompt_blocks_sum += decision.prompt_blocks
        bucket = next((i for i, b in enumerate(HIT_BUCKETS) if hits <= b), len(HIT_BUCKETS))
        self.hit_blocks[bucket] += 1


def sum_stats(stats: list[WorkerStats]) -> WorkerStats:
    """Field-wise sum (every field is a count or a total; the expert load element-wise)."""
    total = WorkerStats()
    for s in stats:
        for name in WorkerStats.__struct_fields__:
            if name != "expert_load":
                setattr(total, name, getattr(total, name) + getattr(s, name))
    total.expert_load = sum_expert_load([s.expert_load for s in stats])
    return total


def expert_load_stats(model: nn.Module) -> ExpertLoadStats | None:
    """A worker's MoE expert counters as a message (None: the model has no sparse layer)."""
    # imported here: the gateway reads this module and never imports torch for it
    from kiln.models.layers.expert_parallel import model_expert_load

    load = model_expert_load(model)
    if load is None:
        return None
    ranks = None if load.rank_tokens is None else load.rank_tokens.tolist()
    return ExpertLoadStats(list(load.layers), load.tokens.tolist(), ranks)


def sum_expert_load(loads: list[ExpertLoadStats | None]) -> ExpertLoadStats | None:
    """The workers' expert loads summed element-wise (workers serve one model); None if none
    reported. Per-rank counts join only where every worker has the same ranks."""
    loads = [load for load in loads if load is not None]
    if not loads:
        return None
    first = loads[0]
    tokens = [[sum(col) for col in zip(*rows, strict=True)]
              for rows in zip(*(load.tokens for load in loads), strict=True)]
    ranks = None
    if all(load.rank_tokens is not None and _shape(load.rank_tokens) == _shape(
            first.rank_tokens) for load in loads):
        ranks = [[sum(col) for col in zip(*rows, strict=True)]
                 for rows in zip(*(load.rank_tokens for load in loads), strict=True)]
    return ExpertLoadStats(first.layers, tokens, ranks)


def max_over_mean(counts: list[int]) -> float:
    """The imbalance figure: the largest count over the mean (1.0: even; 0.0: no counts)."""
    total = sum(counts)
    return max(counts) * len(counts) / total if total else 0.0


def _shape(rows: list[list[int]] | None) -> tuple[int, ...]:
    return () if rows is None else (len(rows), *(len(r) for r in rows))
