"""The step's flat batch (kiln.runner.batch.build_batch) against the tensor derivations it
replaced: positions from the layout, cache slots from the block tables."""

from __future__ import annotations

import torch

from kiln.engine.contract import ScheduledRequest, SchedulerOutput
from kiln.runner.attention import CpuPagedAttention
from kiln.runner.batch import build_batch
from kiln.runner.slots import slot_mapping_for
from kiln.sampling_params import SamplingParams


def item(rid: str, tokens: list[int], start: int, blocks: list[int], drafts: int = 0,
         parents: list[int] | None = None) -> ScheduledRequest:
    return ScheduledRequest(rid, tokens, start, drafts, blocks, True, SamplingParams(),
                            list(range(start + 1)), [], False, draft_parents=parents)


def test_positions_and_slots_equal_the_layout_derivations():
    sched = SchedulerOutput([
        item("prefill", list(range(10, 30)), 5, [7, 3, 9, 12]),  # a chunk across block bounds
        item("decode", [4], 17, [2, 5, 11]),
        item("tree", [1, 2, 3, 4], 8, [6, 1], drafts=3, parents=[-1, -1, 0]),
    ], 25)
    batch = build_batch(sched, torch.device("cpu"), block_size=8)
    layout = batch.layout
    seq = torch.repeat_interleave(torch.arange(3), layout.query_lens)
    derived = torch.arange(25) - layout.query_start[seq] + layout.context_lens[seq]
    assert torch.equal(batch.slot_positions, derived)
    assert torch.equal(batch.slot_mapping, slot_mapping_for(layout, batch.slot_positions, 8))
    assert batch.slot_mapping[:3].tolist() == [7 * 8 + 5, 7 * 8 + 6, 7 * 8 + 7]
    assert batch.slot_mapping[20].item() == 11 * 8 + 1  # position 17: block 2 of [2, 5, 11]
    assert layout.max_query_len == 20 and batch.input_ids[:2].tolist() == [10, 11]
    # the tree's rotary positions are its nodes' depths; its slots stay consecutive
    assert batch.positions[21:].tolist() == [8, 9, 9, 10]
    assert batch.slot_positions[21:].tolist() == [8, 9, 10, 11]
    assert batch.logits_index.tolist() == [19, 20, 21, 22, 23, 24]
    assert build_batch(sched, torch.device("cpu")).slot_mapping is None


def test_decode_steps_take_the_short_kernel_without_reading_the_layout():
    """Every query short (the builder's max_query_len): the layout is the short one as it is;
    a long chunk splits as before."""
    backend = object.__new__(CpuPagedAttention)  # build_metadata needs no kernels
    decode = build_batch(SchedulerOutput([item("a", [4], 17, [2, 5, 11]),
                                          item("b", [9], 3, [4])], 2), torch.device("cpu"), 8)
    meta = backend.build_metadata(decode.layout, decode.slot_positions, 8, decode.slot_mapping)
    assert meta.short is decode.layout and meta.long is None
    assert meta.slot_mapping.tolist() == [11 * 8 + 1, 4 * 8 + 3]
    mixed = build_batch(SchedulerOutput([item("a", [4], 17, [2, 5, 11]),
                                         item("p", list(range(40)), 0, [1, 2, 3, 4, 5])], 41),
                        torch.device("cpu"), 8)
    meta = backend.build_metadata(mixed.layout, mixed.slot_positions, 8, mixed.slot_mapping)
    assert meta.short.query_lens.tolist() == [1] and meta.long.query_lens.tolist() == [40]
