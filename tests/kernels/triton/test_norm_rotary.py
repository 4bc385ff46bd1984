"""RMSNorm, the fused residual add + RMSNorm and in-place rotary
(kiln.kernels.triton.norm_rotary) against their torch references."""

from __future__ import annotations

import pytest
import torch

from kiln.kernels.triton import reference
from kiln.kernels.triton.norm_rotary import fused_add_rms_norm, rms_norm, rotary_inplace
from tests.kernels.triton.common import DEVICES, DTYPES, close


def _randn(*shape, dtype, device, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 96])  # 96: a row shorter than its power-of-2 tile
def test_rms_norm_and_fused_add(device, dtype, hidden):
    x = _randn(5, hidden, dtype=dtype, device=device)
    residual = _randn(5, hidden, dtype=dtype, device=device, seed=1)
    weight = _randn(hidden, dtype=dtype, device=device, seed=2)
    close(rms_norm(x, weight, 1e-6), reference.rms_norm(x, weight, 1e-6), dtype)
    want_out, want_res = reference.fused_add_rms_norm(x, residual.clone(), weight, 1e-6)
    got_out, got_res = fused_add_rms_norm(x, residual, weight, 1e-6)
    assert got_res is residual  # updated in place
    close(got_out, want_out, dtype)
    close(got_res, want_res, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [(4, 4, 64), (4, 2, 128), (8, 2, 64)])
def test_rotary_inplace(device, dtype, heads):
    from kiln.models.layers.rotary import RotaryEmbedding

    hq, hkv, d = heads
    rot = RotaryEmbedding(d, 64, 10000.0)
    cos, sin = rot.cos32.to(device), rot.sin32.to(device)
    qkv = _randn(6, (hq + 2 * hkv) * d, dtype=dtype, device=device)
    positions = torch.tensor([0, 5, 9, 17, 33, 63], device=device)
    want = reference.rotary(qkv, positions, cos, sin, hq, hkv)
    v_before = qkv[:, (hq + hkv) * d:].clone()
    rotary_inplace(qkv, positions, cos, sin, hq, hkv)
    close(qkv, want, dtype)
    assert torch.equal(qkv[:, (hq + hkv) * d:], v_before)


def test_bad_shapes_name_the_numbers():
    with pytest.raises(ValueError, match=r"x must be \[T, H\] and weight \[H\]; got x \(2, 8\)"):
        rms_norm(torch.zeros(2, 8), torch.ones(4), 1e-6)
    with pytest.raises(ValueError, match=r"qkv \(1, 100\) must be \[T, \(2 \+ 2 \* 1\) \* 16\]"):
        rotary_inplace(torch.zeros(1, 100), torch.zeros(1, dtype=torch.int64),
                       torch.ones(4, 16), torch.ones(4, 16), 2, 1)
