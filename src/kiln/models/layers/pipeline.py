"""Pipeline parallelism in the model: which contiguous decoder layers a stage holds.

A model of L decoder layers over P stages: stage s holds layers [start_s, stop_s), the first
stages one more where P does not divide L (the last stage also computes the LM head and
samples, so it gets the lighter share). The first stage holds the embedding, the last the
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


def split_layers(num_layers: int, count: int) -> list[range]:
    """Contiguous layer ranges of `count` stages; earlier stages take the remainder."""
    check_pipeline(count, num_layers)
    base, extra = divmod(num_layers, count)
    ranges, start = [], 0
    for s in range(count):
        stop = start + base + (s < extra)
        ranges.append(range(start, stop))
        start = stop
    return ranges


def stage_of(index: int, count: int, num_layers: int) -> PipelineStage:
    return PipelineStage(index, count, split_layers(num_layers, count)[index])


def check_pipeline(count: int, num_layers: int) -> None:
    """ValueError naming the numbers where the layers cannot fill `count` stages."""
    if count > num_layers:
        raise ValueError(f"pipeline_parallel_size {count} exceeds the model's {num_layers} "
                         f"decoder layers: every stage needs at least one")
