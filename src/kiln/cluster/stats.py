"""Figures the gateway keeps about its cluster (exported by kiln.serve.metrics)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from kiln.cluster.messages import WorkerStats
from kiln.cluster.router import Decision

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
    """Field-wise sum (every field is a count or a total)."""
    total = WorkerStats()
    for s in stats:
        for name in WorkerStats.__struct_fields__:
            setattr(total, name, getattr(total, name) + getattr(s, name))
    return total
