"""kv_cache.cpp: a step's keys and values written to their slots, and slots moved in every
layer's cache at once, against torch indexing."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.common import DTYPES, needs_cpu_kernels

pytestmark = needs_cpu_kernels


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens, threads", [(5, 2), (16, 2), (97, 2), (97, 1)])
def test_write_kv_writes_each_tokens_heads_to_its_slot(dtype, tokens, threads):
    """k and v as column slices of one qkv row (row-strided, heads packed), as the runner
    passes them: row t lands in slot slot_mapping[t] of each cache, nothing else changes
    (from 16 tokens the threads share the rows)."""
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(tokens, 3 * 2 * 8, generator=gen).to(dtype)
    k, v = qkv[:, 16:32].view(tokens, 2, 8), qkv[:, 32:].view(tokens, 2, 8)
    k_cache, v_cache = torch.zeros(200, 2, 8, dtype=dtype), torch.zeros(200, 2, 8, dtype=dtype)
    slots = torch.randperm(200, generator=gen)[:tokens]
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    expected_k[slots], expected_v[slots] = k, v
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.ops.kiln.write_kv(k, v, k_cache, v_cache, slots)
        assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
        k_own = k.contiguous()  # k made contiguous (its own row stride), v a slice of qkv
        k_cache.zero_(), v_cache.zero_()
        torch.ops.kiln.write_kv(k_own, v, k_cache, v_cache, slots)
        assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", DTYPES)
def test_move_slots_moves_every_caches_rows_as_torch_indexing_does(dtype):
    """An accepted tree path's KV moved in every layer at once: slots that are both a source
    and a destination (a swap, a chain) read their rows from before the move."""
    gen = torch.Generator().manual_seed(0)
    caches = [torch.randn(40, 3, 8, generator=gen).to(dtype) for _ in range(4)]
    src, dst = torch.tensor([5, 6, 9, 12, 13]), torch.tensor([6, 5, 12, 13, 30])
    expected = [c.clone() for c in caches]
    for c in expected:
        c[dst] = c[src]
    torch.ops.kiln.move_slots(caches, src, dst)
    for got, want in zip(caches, expected, strict=True):
        assert torch.equal(got, want)
    with pytest.raises(RuntimeError, match="slot out of range"):
        torch.ops.kiln.move_slots(caches, torch.tensor([40]), torch.tensor([0]))
