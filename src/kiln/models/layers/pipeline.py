"""Pipeline parallelism in the model: which contiguous decoder layers a stage holds.

A model of L decoder layers over P stages: stage s holds layers [start_s, stop_s). The last
stage also runs the LM head (as much work per token as `head_cost` decoder layers: 8 for a
135M model with a 49K vocabulary, 1.5 for a 1B one), so it takes that many fewer layers and
the others share the rest evenly (earlier stages one more where it does not divide). The first stage holds the embedding, the last the
final norm and the LM head (and, with tied embeddings, the embedding table its head is
copied from). A model built with a stage loads only its own checkpoint tensors and the
runner allocates KV for its own layers only.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PipelineStage:
    """Stage `index` of `count`, holding decoder layers `layers` of the model."""

    index: int
    count: int
    layers: range

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.count - 1

    @classmethod
    def whole(cls, num_layers: int) -> PipelineStage:
        """The one stage of a model run in one process."""
        return cls(0, 1, range(num_layers))


def split_layers(num_layers: int, count: int, head_cost: float = 0.0) -> list[range]:
    """Contiguous layer ranges of `count` stages of about equal work, the LM head (on the
    last) counting as `head_cost` layers; every stage holds at least one layer."""
    check_pipeline(count, num_layers)
    last = round((num_layers + head_cost) / count - head_cost)
    last = min(max(1, last), num_layers - (count - 1))
    base, extra = divmod(num_layers - last, count - 1) if count > 1 else (0, 0)
    sizes = [base + (s < extra) for s in range(count - 1)] + [last]
    ranges, start = [], 0
    for size in sizes:
        ranges.append(range(start, start + size))
        start += size
    return ranges


def stage_of(index: int, count: int, num_layers: int, head_cost: float = 0.0) -> PipelineStage:
    return PipelineStage(index, count, split_layers(num_layers, count, head_cost)[index])


def check_pipeline(count: int, num_layers: int) -> None:
    """ValueError naming the numbers where the layers cannot fill `count` stages."""
    if count > num_layers:
        raise ValueError(f"pipeline_parallel_size {count} exceeds the model's {num_layers} "
                         f"decoder layers: every stage needs at least one")
