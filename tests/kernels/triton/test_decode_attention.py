"""Paged decode attention (kiln.kernels.triton.decode_attention) against its torch reference:
GQA 1/2/4, head dims 64 and 128, partial last blocks, sequences of different lengths, empty
rows, one pass and split along the sequence."""

from __future__ import annotations

import pytest
import torch

from kiln.kernels.triton import reference
from kiln.kernels.triton.decode_attention import choose_num_splits, paged_decode_attention
from tests.kernels.triton.common import DEVICES, DTYPES, close, paged_batch

# (Hq, Hkv, D, block_size, seq lens, splits): the last blocks are partial; one row is empty
CASES = [
    (2, 2, 64, 16, [1, 17, 40], 1),
    (4, 2, 128, 8, [33, 0, 9], 1),
    (8, 2, 64, 16, [50, 5, 0], 3),
    (4, 1, 128, 4, [37, 64], 4),
]


def _run(device, dtype, hq, hkv, d, block_size, lens, splits):
    batch = paged_batch([n - 1 if n else 0 for n in lens], [1 if n else 0 for n in lens], hq,
                        hkv, d, block_size, dtype, device)
    seq_lens = torch.tensor(lens, device=device)
    q = torch.randn(len(lens), hq, d, generator=torch.Generator().manual_seed(1)).to(dtype)
    q = q.to(device)
    scale = d ** -0.5
    got = paged_decode_attention(q, batch.k_cache, batch.v_cache, batch.block_table, seq_lens,
                                 block_size, scale, num_splits=splits)
    want = reference.paged_decode_attention(q, batch.k_cache, batch.v_cache,
                                            batch.block_table, seq_lens, block_size, scale)
    return got, want


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"gqa{c[0] // c[1]}-d{c[2]}-s{c[5]}")
def test_decode_matches_reference(device, dtype, case):
    got, want = _run(device, dtype, *case)
    close(got, want, dtype)
    empty = [s for s, n in enumerate(case[4]) if n == 0]
    assert torch.all(got[empty] == 0)


@pytest.mark.parametrize("device", DEVICES)
def test_more_splits_than_keys_agree_with_one_pass(device):
    one, want = _run(device, torch.float32, 4, 2, 64, 4, [3, 20], 1)
    many, _ = _run(device, torch.float32, 4, 2, 64, 4, [3, 20], 8)
    close(one, want, torch.float32)
    close(many, one, torch.float32)


def test_choose_num_splits_fills_the_gpu_only_for_long_contexts():
    assert choose_num_splits(max_seq_len=100, num_seqs=1, num_kv_heads=8) == 1
    assert choose_num_splits(max_seq_len=8192, num_seqs=1, num_kv_heads=8) == 32
    assert choose_num_splits(max_seq_len=8192, num_seqs=64, num_kv_heads=8) == 1


def test_bad_arguments_name_the_numbers():
    batch = paged_batch([3], [1], 4, 2, 64, 4, torch.float32, "cpu")
    with pytest.raises(ValueError, match="3 query heads are not a multiple of 2"):
        paged_decode_attention(torch.zeros(1, 3, 64), batch.k_cache, batch.v_cache,
                               batch.block_table, batch.seq_lens, 4, 1.0)
    with pytest.raises(ValueError, match="num_splits must be >= 1; got 0"):
        paged_decode_attention(batch.q, batch.k_cache, batch.v_cache, batch.block_table,
                               batch.seq_lens, 4, 1.0, num_splits=0)
