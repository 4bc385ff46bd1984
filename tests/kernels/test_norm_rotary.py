"""norm_rotary.cpp: RMS norm (with the fused residual add), SiLU-and-mul and in-place rotary
against their torch references (kiln.models.layers.ops.TorchOps)."""

from __future__ import annotations

import pytest
import torch

from kiln.models.layers.ops import KernelOps, TorchOps
from tests.kernels.common import DTYPES, close, needs_cpu_kernels

pytestmark = needs_cpu_kernels


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_and_fused_residual_add(dtype):
    ref, ker = TorchOps(), KernelOps()
    x, res = torch.randn(7, 96, dtype=dtype), torch.randn(7, 96, dtype=dtype)
    w = torch.randn(96, dtype=dtype)
    close(ker.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6), dtype)
    out_r, res_r = ref.add_rms_norm(x, res.clone(), w, 1e-6)
    out_k, res_k = ker.add_rms_norm(x, res.clone(), w, 1e-6)
    close(out_k, out_r, dtype)
    close(res_k, res_r, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(dtype):
    x = torch.randn(5, 2 * 48, dtype=dtype)
    close(KernelOps().silu_mul(x), TorchOps().silu_mul(x), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_inplace_matches_reference(dtype):
    from kiln.models.layers.rotary import RotaryEmbedding

    hq, hkv, d, t = 4, 2, 32, 6
    rot = RotaryEmbedding(d, 64, 10000.0, dtype=dtype)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, dtype=dtype)
    pos = torch.tensor([0, 5, 9, 17, 33, 63])
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    rq, rk = TorchOps().rotary(q.reshape(t, hq, d), k.reshape(t, hkv, d), pos, rot.cos, rot.sin)
    fused = qkv.clone()
    rot.apply_inplace(fused, pos, hq, hkv)
    fq, fk, fv = fused.split([hq * d, hkv * d, hkv * d], dim=-1)
    close(fq.reshape(t, hq, d), rq, dtype)
    close(fk.reshape(t, hkv, d), rk, dtype)
    assert torch.equal(fv, v)
