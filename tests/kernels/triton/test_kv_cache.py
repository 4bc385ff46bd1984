"""Writing K/V into paged blocks by slot mapping (kiln.kernels.triton.kv_cache)."""

from __future__ import annotations

import pytest
import torch

from kiln.kernels.triton import reference
from kiln.kernels.triton.kv_cache import write_kv
from tests.kernels.triton.common import DEVICES, DTYPES


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [(2, 2, 64), (4, 1, 128), (6, 3, 64)], ids=str)
def test_write_kv_matches_reference(device, dtype, heads):
    # k and v are strided views into a fused qkv output, as a model's attention hands them
    hq, hkv, d = heads
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(5, (hq + 2 * hkv) * d, generator=gen).to(dtype).to(device)
    k = qkv[:, hq * d:(hq + hkv) * d].view(5, hkv, d)
    v = qkv[:, (hq + hkv) * d:].view(5, hkv, d)
    slots = torch.tensor([9, 0, 31, 17, 4], device=device)  # scattered over 4 blocks of 8
    k_cache = torch.randn(32, hkv, d, generator=gen).to(dtype).to(device)
    v_cache = torch.randn(32, hkv, d, generator=gen).to(dtype).to(device)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    reference.write_kv(k, v, want_k, want_v, slots)
    write_kv(k, v, k_cache, v_cache, slots.to(torch.int32))
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


def test_slot_mapping_length_is_checked():
    cache = torch.zeros(8, 2, 64)
    with pytest.raises(ValueError, match=r"slot_mapping is \(2,\); expected \[3\]"):
        write_kv(torch.zeros(3, 2, 64), torch.zeros(3, 2, 64), cache, cache.clone(),
                 torch.zeros(2, dtype=torch.int64))
