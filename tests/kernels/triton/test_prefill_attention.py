"""Paged prefill/extend attention (kiln.kernels.triton.prefill_attention) against its torch
reference: chunks over cached prefixes (longer than the chunk too), several sequences of
different lengths, GQA 1/2/4, head dims 64 and 128, partial last blocks, draft-tree masks."""

from __future__ import annotations

import pytest
import torch

from kiln.kernels.triton import reference
from kiln.kernels.triton.prefill_attention import paged_prefill_attention
from tests.kernels.triton.common import DEVICES, DTYPES, close, paged_batch

# (Hq, Hkv, D, block_size, context lens, query lens)
CASES = [
    (2, 2, 64, 16, [0, 0], [19, 5]),  # plain prompts, one past a 16-row tile
    (4, 2, 128, 8, [21, 3], [6, 17]),  # a prefix longer than its chunk; a short prefix
    (8, 2, 64, 4, [0, 30, 7, 5], [3, 1, 10, 0]),  # a decode row among chunks; an idle row
    (4, 1, 128, 16, [40], [2]),
]


def _check(device, dtype, hq, hkv, d, block_size, contexts, queries, tree_mask=None):
    b = paged_batch(contexts, queries, hq, hkv, d, block_size, dtype, device)
    args = (b.q, b.k_cache, b.v_cache, b.block_table, b.query_start, b.query_lens,
            b.context_lens, block_size, d ** -0.5)
    tree = None if tree_mask is None else tree_mask.to(device)
    got = paged_prefill_attention(*args, max_query_len=max(queries), tree_mask=tree)
    close(got, reference.paged_prefill_attention(*args, tree_mask=tree), dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"gqa{c[0] // c[1]}-d{c[2]}-q{sum(c[5])}")
def test_prefill_matches_reference(device, dtype, case):
    _check(device, dtype, *case)


def _tree_bits(parents: list[int]) -> list[int]:
    """Each draft token's bits: itself and its ancestors (parents[i] < i, -1 for the root)."""
    bits = []
    for i, parent in enumerate(parents):
        bits.append((1 << i) | (bits[parent] if parent >= 0 else 0))
    return bits


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_tree_masks_match_reference(device, dtype):
    # sequence 0 verifies a 6-token tree (two branches) after 13 cached tokens; sequence 1 is
    # a plain causal chunk in the same batch (bits 0)
    tree = _tree_bits([-1, 0, 0, 1, 2, 2]) + [0] * 4
    _check(device, dtype, 4, 2, 64, 4, [13, 9], [6, 4], torch.tensor(tree))


def test_tree_rows_see_only_their_ancestors():
    bits = torch.tensor(_tree_bits([-1, 0, 0, 2]))
    visible = reference.tree_visibility(bits, context_len=2, seq_len=6)
    assert visible.tolist() == [
        [True, True, True, False, False, False],
        [True, True, True, True, False, False],
        [True, True, True, False, True, False],
        [True, True, True, False, True, True],
    ]


def test_bad_tree_mask_names_the_shape():
    b = paged_batch([2], [3], 2, 2, 64, 4, torch.float32, "cpu")
    with pytest.raises(ValueError, match=r"tree_mask must be int64 \[3\]"):
        paged_prefill_attention(b.q, b.k_cache, b.v_cache, b.block_table, b.query_start,
                                b.query_lens, b.context_lens, 4, 1.0, max_query_len=3,
                                tree_mask=torch.zeros(3, dtype=torch.int32))
