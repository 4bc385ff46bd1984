"""The torch references of kiln.kernels.triton against what the engine computes today: kiln's
torch attention backend, TorchOps and the quant formats' dequantization, one shared case each,
so that a kernel matching its reference matches the engine."""

from __future__ import annotations

import torch

from kiln.kernels.triton import reference
from tests.kernels.triton.common import paged_batch

BLOCK = 4


def test_attention_references_match_the_torch_backend():
    from kiln.models.layers.attention import SeqLayout
    from kiln.runner.attention import TorchPagedAttention

    # a 5-token chunk after a 9-token prefix, a decode, a 4-token draft tree after 6 tokens
    contexts, queries = [9, 7, 6], [5, 1, 4]
    b = paged_batch(contexts, queries, 4, 2, 64, BLOCK, torch.float32, "cpu")
    gen = torch.Generator().manual_seed(3)
    k, v = (torch.randn(sum(queries), 2, 64, generator=gen) for _ in range(2))
    tree = torch.tensor([0] * 6 + [0b1, 0b11, 0b101, 0b1011])
    layout = SeqLayout(b.query_start, b.query_lens, b.context_lens, b.block_table, tree)
    positions = torch.cat([torch.arange(c, c + n) for c, n in zip(contexts, queries, strict=True)])
    backend = TorchPagedAttention()
    meta = backend.build_metadata(layout, positions, BLOCK)
    kv_cache = (b.k_cache.clone(), b.v_cache.clone())
    engine = backend.forward(b.q, k, v, kv_cache, meta, 0.125).view(b.q.shape)

    k_cache, v_cache = b.k_cache.clone(), b.v_cache.clone()
    reference.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    assert torch.equal(k_cache, kv_cache[0]) and torch.equal(v_cache, kv_cache[1])
    ours = reference.paged_prefill_attention(b.q, k_cache, v_cache, b.block_table,
                                             b.query_start, b.query_lens, b.context_lens,
                                             BLOCK, 0.125, tree_mask=tree)
    torch.testing.assert_close(ours, engine, atol=1e-5, rtol=1e-5)
    decode = reference.paged_decode_attention(b.q[5:6], k_cache, v_cache, b.block_table[1:2],
                                              b.seq_lens[1:2], BLOCK, 0.125)
    torch.testing.assert_close(decode, engine[5:6], atol=1e-5, rtol=1e-5)


def test_norm_and_rotary_references_match_torch_ops():
    from kiln.models.layers.ops import TorchOps
    from kiln.models.layers.rotary import RotaryEmbedding

    gen = torch.Generator().manual_seed(0)
    x, residual, weight = (torch.randn(3, 64, generator=gen).bfloat16() for _ in range(3))
    weight = weight[0]
    want = TorchOps().add_rms_norm(x, residual, weight, 1e-6)
    got = reference.fused_add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])

    rot = RotaryEmbedding(64, 32, 10000.0)
    qkv = torch.randn(4, (4 + 2 * 2) * 64, generator=gen)
    positions = torch.tensor([0, 3, 17, 31])
    q, k = qkv[:, :256].view(4, 4, 64), qkv[:, 256:384].view(4, 2, 64)
    want_q, want_k = TorchOps().rotary(q, k, positions, rot.cos, rot.sin)
    got = reference.rotary(qkv, positions, rot.cos32, rot.sin32, 4, 2)
    torch.testing.assert_close(got[:, :256].view(4, 4, 64), want_q)
    torch.testing.assert_close(got[:, 256:384].view(4, 2, 64), want_k)


def test_gemv_reference_matches_the_formats_dequantization():
    from kiln.quant.formats import get_format

    gen = torch.Generator().manual_seed(0)
    w, x = torch.randn(24, 40, generator=gen), torch.randn(2, 40, generator=gen)
    for name in ("int8", "fp8"):
        fmt = get_format(name)
        packed = fmt.quantize(w, fmt.params(w))
        want = x @ fmt.dequantize(packed).t()
        got = reference.weight_only_gemv(x, packed["weight"], packed["weight_scale"])
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
