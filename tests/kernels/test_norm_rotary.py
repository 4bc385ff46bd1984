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


@pytest.mark.parametrize("dtype", DTYPES)
def test_qk_norm_rotary_is_the_norm_kernel_then_the_rotary_kernel(dtype):
    """Qwen3's fused per-head q/k norm and rotation: bit for bit the C++ rms_norm over each q
    and k head followed by rotary_inplace (v untouched), and close to the torch reference."""
    from kiln.models.layers.rotary import RotaryEmbedding

    hq, hkv, d, t = 4, 2, 32, 6
    rot = RotaryEmbedding(d, 64, 10000.0, dtype=dtype)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, dtype=dtype) * 3
    qw, kw = torch.randn(d, dtype=dtype), torch.randn(d, dtype=dtype)
    pos = torch.tensor([0, 5, 9, 17, 33, 63])
    two_calls = qkv.clone()
    q, k, _ = two_calls.split([hq * d, hkv * d, hkv * d], dim=-1)
    q.copy_(torch.ops.kiln.rms_norm(q.reshape(t, hq, d), qw, 1e-6).reshape(t, hq * d))
    k.copy_(torch.ops.kiln.rms_norm(k.reshape(t, hkv, d), kw, 1e-6).reshape(t, hkv * d))
    rot.apply_inplace(two_calls, pos, hq, hkv)
    fused = qkv.clone()
    fq, fk, fv = KernelOps().qk_norm_rotary_qkv(fused, pos, rot, qw, kw, 1e-6, hq, hkv)
    assert torch.equal(fused, two_calls)
    assert torch.equal(fv.reshape(t, -1), qkv[:, (hq + hkv) * d:])
    rq, rk, _ = TorchOps().qk_norm_rotary_qkv(qkv.clone(), pos, rot, qw, kw, 1e-6, hq, hkv)
    close(fq, rq, dtype)
    close(fk, rk, dtype)


@pytest.mark.parametrize("dim", [96, 100, 7])  # whole 16-lane vectors, a tail, only a tail
def test_bf16_norm_and_silu_rows_do_not_depend_on_their_batch(dim):
    """A bf16 row's norm and SiLU-and-mul (16 lanes at a time, the tail one by one) are the
    same alone as among other rows, and close to torch's."""
    ker, ref = KernelOps(), TorchOps()
    g = torch.Generator().manual_seed(dim)
    x = torch.randn(9, dim, generator=g).bfloat16()
    res = torch.randn(9, dim, generator=g).bfloat16()
    w = torch.randn(dim, generator=g).bfloat16()
    whole = ker.rms_norm(x, w, 1e-6)
    assert torch.equal(torch.cat([ker.rms_norm(x[i:i + 1], w, 1e-6) for i in range(9)]), whole)
    close(whole, ref.rms_norm(x, w, 1e-6), torch.bfloat16)
    out, summed = ker.add_rms_norm(x, res.clone(), w, 1e-6)
    for i in range(9):
        one, one_sum = ker.add_rms_norm(x[i:i + 1], res[i:i + 1].clone(), w, 1e-6)
        assert torch.equal(one, out[i:i + 1]) and torch.equal(one_sum, summed[i:i + 1])
    assert torch.equal(summed, (res.float() + x.float()).bfloat16())  # the residual add rounds once
    gate_up = torch.randn(9, 2 * dim, generator=g).bfloat16() * 4
    act = ker.silu_mul(gate_up)
    assert torch.equal(torch.cat([ker.silu_mul(gate_up[i:i + 1]) for i in range(9)]), act)
    close(act, ref.silu_mul(gate_up), torch.bfloat16)
