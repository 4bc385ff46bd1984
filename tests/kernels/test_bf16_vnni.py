"""gemm_vnni.cpp: bf16 linears on VNNI-packed weights (`bf16_vnni_mm`) against an exact fp32
matmul, at every token count and both output dtypes; the packing round trip; batch
invariance (a token's outputs do not depend on the others in its step); and the linear method
that serves the model with it."""

from __future__ import annotations

import pytest
import torch

from kiln.kernels.bf16_vnni import pack_vnni, unpack_vnni, vnni_available, vnni_mm
from tests.kernels.common import needs_cpu_kernels

pytestmark = [needs_cpu_kernels,
              pytest.mark.skipif(not vnni_available(), reason="no AVX512-BF16 on this CPU")]

# (K, N): the default model's qkv / down projections, odd K, N off the 16-row block, N under
# one panel of 4 blocks, N of 5 blocks (a panel and a narrower one)
SHAPES = [(576, 960), (1536, 576), (33, 40), (7, 5), (64, 80)]
TOKENS = [1, 2, 3, 5, 8, 13, 24, 64, 257]  # from 8 to 256 a panel fetches the next one ahead


def layer(k: int, n: int, m: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    return x, w


@pytest.mark.parametrize("k,n", SHAPES)
def test_packing_round_trips_exactly(k, n):
    _, w = layer(k, n, 1)
    packed = pack_vnni(w)
    assert packed.shape == ((n + 15) // 16, (k + 1) // 2, 16, 2)
    assert torch.equal(unpack_vnni(packed, n, k), w)


@pytest.mark.parametrize("k,n", SHAPES)
@pytest.mark.parametrize("m", TOKENS)
def test_matches_an_exact_matmul(k, n, m):
    x, w = layer(k, n, m)
    exact = x.double() @ w.double().T  # each bf16 product is exact; fp32 sums round
    got = vnni_mm(x, pack_vnni(w), n, fp32_out=True)
    assert got.dtype == torch.float32 and got.shape == (m, n)
    torch.testing.assert_close(got.double(), exact, atol=1e-4 * k ** 0.5, rtol=1e-5)
    rounded = vnni_mm(x, pack_vnni(w), n)
    assert rounded.dtype == torch.bfloat16
    assert torch.equal(rounded, got.to(torch.bfloat16))  # one rounding of the same sums


@pytest.mark.parametrize("fp32_out", [False, True])
def test_a_tokens_outputs_do_not_depend_on_its_batch(fp32_out):
    x, w = layer(576, 960, 21, seed=1)
    packed = pack_vnni(w)
    alone = torch.cat([vnni_mm(x[i:i + 1], packed, 960, fp32_out) for i in range(21)])
    for m in (2, 4, 7, 8, 16, 21):
        assert torch.equal(vnni_mm(x[:m], packed, 960, fp32_out), alone[:m])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert torch.equal(vnni_mm(x, packed, 960, fp32_out), alone)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("k,n", SHAPES)
@pytest.mark.parametrize("fp32_out", [False, True])
def test_one_tokens_stream_prefetch_leaves_the_sums_alone(k, n, fp32_out):
    # the non-temporal prefetch ahead of a one-token GEMV (decision 0024), at distances inside
    # a block, across blocks and past the weights' end, gives the bits it gives without
    x, w = layer(k, n, 1, seed=2)
    packed = pack_vnni(w)
    before = torch.ops.kiln.set_vnni_stream_ahead(0)
    try:
        plain = vnni_mm(x, packed, n, fp32_out)
        for bytes_ahead in (64, 4096, 1 << 20):
            torch.ops.kiln.set_vnni_stream_ahead(bytes_ahead)
            assert torch.equal(vnni_mm(x, packed, n, fp32_out), plain)
        assert torch.ops.kiln.set_vnni_stream_ahead(0) == 1 << 20  # returns the one replaced
    finally:
        torch.ops.kiln.set_vnni_stream_ahead(before)
    with pytest.raises(RuntimeError, match="-1 bytes: expected 0 .off. to 1 MiB"):
        torch.ops.kiln.set_vnni_stream_ahead(-1)


def test_bad_shapes_fail_with_the_numbers():
    x, w = layer(64, 32, 2)
    with pytest.raises(RuntimeError, match="x has 62 features, w packs 64"):
        vnni_mm(x[:, :62], pack_vnni(w), 32)
    with pytest.raises(RuntimeError, match="50 outputs do not fit 2 blocks"):
        vnni_mm(x, pack_vnni(w), 50)
    assert vnni_mm(x[:0], pack_vnni(w), 32).shape == (0, 32)


def test_the_linear_method_serves_a_layer_as_its_weight_would():
    from kiln.models.layers.linear import Linear, get_linear_method
    from kiln.models.loader import dense_method

    assert dense_method(torch.bfloat16, "vnni") == "dense-vnni"
    x, w = layer(96, 48, 5, seed=2)
    method = get_linear_method("dense-vnni")
    linear = Linear(96, [16, 32], bias=True, dtype=torch.bfloat16, method=method)
    method.load_shard(linear, 0, "weight", w[:16])
    method.load_shard(linear, 1, "weight", w[16:])
    bias = torch.randn(48).to(torch.bfloat16)
    method.load_shard(linear, 0, "bias", bias[:16])
    method.load_shard(linear, 1, "bias", bias[16:])
    method.finalize(linear)
    assert linear.weight.numel() == 0 and torch.equal(method.dense_weight(linear), w)
    exact = (x.float() @ w.float().T + bias.float())
    torch.testing.assert_close(linear(x).float(), exact, atol=3e-2, rtol=1e-2)
    torch.testing.assert_close(method.apply_fp32(linear, x), exact, atol=1e-4, rtol=1e-5)
    assert method.stack_tensors(linear) is None  # a bias: the fused stack cannot run it
    odd = Linear(96, 40, dtype=torch.bfloat16, method=get_linear_method("dense-vnni"))
    odd.method.load_shard(odd, 0, "weight", w[:40])
    odd.method.finalize(odd)  # 40 rows: not whole blocks, so oneDNN's packing
    assert not hasattr(odd, "vnni_weight") and torch.equal(odd.method.dense_weight(odd), w[:40])


def test_the_lm_head_is_packed_whatever_its_vocabulary():
    """A head of 40 rows (not whole blocks) is VNNI-packed anyway, its logits the fp32 sums of
    the exact product, and it declines the fused stack (which reads whole blocks only)."""
    from kiln.models.layers.linear import Linear, get_linear_method
    from kiln.models.loader import _lm_head_dense

    assert _lm_head_dense("dense-vnni") == "dense-vnni-head"
    x, w = layer(96, 40, 3, seed=4)
    head = Linear(96, 40, dtype=torch.bfloat16, method=get_linear_method("dense-vnni-head"))
    head.method.load_shard(head, 0, "weight", w)
    head.method.finalize(head)
    assert head.vnni_weight.shape == (3, 48, 16, 2) and head.weight.numel() == 0
    assert torch.equal(head.method.dense_weight(head), w)
    logits = head.method.apply_fp32(head, x)
    assert logits.dtype == torch.float32 and logits.shape == (3, 40)
    torch.testing.assert_close(logits, x.float() @ w.float().T, atol=1e-4, rtol=1e-5)
    assert head.method.stack_tensors(head) is None
