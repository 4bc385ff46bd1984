"""The head packed for inference (fused q/k/v and gate/up, the target's ops) computes what
the plain head computes."""

from __future__ import annotations

import copy

import pytest
import torch

from kiln.models.layers.ops import get_ops
from kiln.speculative.head.model import EagleHead, HeadConfig, pack_for_inference


def causal(c: HeadConfig):
    def attend(q, k, v):
        rep = c.num_heads // c.num_kv_heads
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True)
        return out.transpose(0, 1).reshape(len(q), -1)
    return attend


@pytest.mark.parametrize("ops_name", ["torch", "auto"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_head_matches_the_plain_head(ops_name, dtype):
    c = HeadConfig(hidden_size=64, intermediate_size=96, num_heads=4, num_kv_heads=2,
                   head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None,
                   max_position_embeddings=64, vocab_size=100, draft_vocab_size=100)
    torch.manual_seed(0)
    plain = EagleHead(c).to(dtype).eval().requires_grad_(False)
    with torch.no_grad():  # non-trivial norms
        plain.layer.input_layernorm.uniform_(0.5, 1.5)
        plain.layer.post_attention_layernorm.uniform_(0.5, 1.5)
    packed = pack_for_inference(copy.deepcopy(plain), get_ops(ops_name))
    assert packed.layer.fused is not None and not hasattr(packed.layer, "q_proj")
    t = 7
    g, emb = torch.randn(t, 64, dtype=dtype), torch.randn(t, 64, dtype=dtype)
    angle = torch.arange(t)[:, None, None] * torch.rand(1, 1, 16)
    cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
    with torch.inference_mode():
        want = plain(g, emb, cos, sin, causal(c)).float()
        got = packed(g, emb, cos, sin, causal(c)).float()
    tol = 1e-4 if dtype == torch.float32 else 0.05
    assert (got - want).abs().max() <= tol * want.abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_small_batch_int8_linear(dtype):
    """int8 weight-only rows serve inputs of up to INT8_GEMV_MAX_TOKENS rows (at most
    ONEDNN_MAX_INT8_ROWS beside a oneDNN-packed bf16 copy, which is faster from there), within
    int8's rounding of the dense product; larger inputs take the dense weight exactly."""
    from kiln.kernels.quant_mm import INT8_GEMV_MAX_TOKENS
    from kiln.models.layers.onednn import OneDNNLinearMethod
    from kiln.speculative.head.model import (
        ONEDNN_MAX_INT8_ROWS,
        SmallBatchInt8,
        int8_gemv_available,
        packed_linear,
    )

    if not int8_gemv_available():
        pytest.skip("kiln's C++ kernels did not build here")  # the dense path is then used
    torch.manual_seed(0)
    weight = torch.randn(96, 64, dtype=dtype)
    linear = packed_linear(weight, int8=True)
    assert isinstance(linear, SmallBatchInt8)
    onednn = isinstance(linear.dense.method, OneDNNLinearMethod)
    assert linear.max_rows == (min(INT8_GEMV_MAX_TOKENS, ONEDNN_MAX_INT8_ROWS) if onednn
                               else INT8_GEMV_MAX_TOKENS)
    small = torch.randn(3, 64, dtype=dtype)
    large = torch.randn(linear.max_rows + 1, 64, dtype=dtype)
    with torch.inference_mode():
        want = (small.float() @ weight.float().T)
        got = linear(small).float()
        assert not torch.equal(got, linear.dense(small).float())  # really the int8 copy
        assert (got - want).abs().max() <= 0.03 * want.abs().max()
        assert torch.equal(linear(large), linear.dense(large))


def test_int8_packed_head_drafts_like_the_dense_one():
    """The whole head packed with int8 linears: outputs within int8 rounding of the dense
    packing, and the same argmax (draft) at almost every row."""
    from kiln.speculative.head.model import int8_gemv_available

    if not int8_gemv_available():
        pytest.skip("kiln's C++ kernels did not build here")
    c = HeadConfig(hidden_size=64, intermediate_size=96, num_heads=4, num_kv_heads=2,
                   head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None,
                   max_position_embeddings=64, vocab_size=100, draft_vocab_size=100)
    torch.manual_seed(0)
    plain = EagleHead(c).eval().requires_grad_(False)
    ops = get_ops("auto")
    dense = pack_for_inference(copy.deepcopy(plain), ops)
    int8 = pack_for_inference(copy.deepcopy(plain), ops, int8=True)
    t = 6
    g, emb = torch.randn(t, 64), torch.randn(t, 64)
    angle = torch.arange(t)[:, None, None] * torch.rand(1, 1, 16)
    cos, sin = angle.cos(), angle.sin()
    lm = torch.randn(100, 64)
    with torch.inference_mode():
        want = dense(g, emb, cos, sin, causal(c))
        got = int8(g, emb, cos, sin, causal(c))
    assert (got - want).abs().max() <= 0.05 * want.abs().max()
    agree = (got @ lm.T).argmax(-1) == (want @ lm.T).argmax(-1)
    assert agree.float().mean() >= 5 / 6


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("width", [1, 3])
def test_draft_rows_attend_their_context_and_own_path(backend, width):
    """Each draft row of a round is a paged sequence of its own: at every step it attends its
    sequence's context keys in the head's cache and the keys of its own path's earlier steps
    (beams reordered between steps, two rows continuing one beam), with GQA (query head i
    reads kv head i // 2), as a per-row softmax over exactly those keys; the context's blocks
    are never written. One context ends inside a block, the other on a block boundary."""
    from kiln.kernels import cpu as cpu_kernels
    from kiln.runner.attention import get_attention_backend, slot_mapping_for
    from kiln.speculative.head.kv import DraftRows, HeadKV

    kernels = cpu_kernels.load()
    if backend == "cpu" and not kernels:
        pytest.skip("kiln's C++ kernels did not build here")
    torch.manual_seed(0)
    bs, hq, hkv, d, scale = 4, 4, 2, 8, 0.3
    attention = get_attention_backend(backend)
    cache = HeadKV(10 * bs, hkv, d, torch.float32, bs, torch.device("cpu"))
    for t in cache.kv:
        t.normal_()
    main = [t.clone() for t in cache.kv]
    ctx_len, tables = torch.tensor([5, 8]), torch.tensor([[3, 7, 0], [1, 5, 0]])
    rows = DraftRows(cache, ctx_len, tables, width, width, 3, kernels)
    b = len(ctx_len)
    paths = [[] for _ in range(b * width)]  # each row's (k, v) of its earlier steps
    for step in range(3):
        if step:  # a beam search's reorder: rows of the same sequence, shuffled
            kept = torch.cat([s * width + torch.randperm(width) for s in range(b)])
            if width > 1:
                kept[0] = kept[1]  # two rows continue the same beam
            rows.reorder(kept)
            paths = [list(paths[r]) for r in kept.tolist()]
        layout, positions, slots = rows.layout(step)
        assert torch.equal(slots, slot_mapping_for(layout, positions, bs))
        meta = attention.build_metadata(layout, positions, bs, slots)
        q, k, v = (torch.randn(b * width, h, d) for h in (hq, hkv, hkv))
        out = attention.forward(q, k, v, cache.kv, meta, scale).view(b * width, hq, d)
        for row in range(b * width):
            paths[row].append((k[row], v[row]))
            s = row // width
            pos = torch.arange(int(ctx_len[s]))
            slots = tables[s][pos // bs] * bs + pos % bs
            keys = torch.cat([main[0][slots], torch.stack([pk for pk, _ in paths[row]])])
            values = torch.cat([main[1][slots], torch.stack([pv for _, pv in paths[row]])])
            for head in range(hq):
                p = (keys[:, head // 2] @ q[row, head] * scale).softmax(0)
                torch.testing.assert_close(out[row, head], p @ values[:, head // 2])
    for t, before in zip(cache.kv, main, strict=True):
        assert torch.equal(t[:len(before)], before)
