"""paged_attention.cpp and prefill_attention.cpp: the cpu attention backend (short queries, draft
trees, long prefill chunks) against the torch backend and exact fp32 attention; write_kv's
slots along the way."""

from __future__ import annotations

import pytest
import torch

from kiln.kernels import cpu as cpu_kernels
from kiln.runner.attention import (
    CpuPagedAttention,
    SeqLayout,
    TorchPagedAttention,
    slot_mapping_for,
)
from tests.kernels.common import DTYPES, TOL, close, needs_cpu_kernels

pytestmark = needs_cpu_kernels


def random_batch(dtype, query_lens, context_lens, hq=6, hkv=2, d=64, bs=4):
    """A flat batch over a shuffled block pool, with the cache prefilled for the contexts."""
    gen = torch.Generator().manual_seed(0)
    per_seq = [-(-(c + q) // bs) for q, c in zip(query_lens, context_lens, strict=True)]
    perm = torch.randperm(sum(per_seq) + 3, generator=gen)
    tables, start = [], 0
    for n in per_seq:
        tables.append(perm[start:start + n].tolist())
        start += n
    width = max(per_seq)
    layout = SeqLayout(
        query_start=torch.tensor([0] + list(torch.tensor(query_lens).cumsum(0)[:-1])),
        query_lens=torch.tensor(query_lens), context_lens=torch.tensor(context_lens),
        block_table=torch.tensor([t + [0] * (width - len(t)) for t in tables]))
    t = sum(query_lens)
    positions = torch.cat([torch.arange(c, c + q) for q, c in zip(query_lens, context_lens,
                                                                   strict=True)])
    slots = (perm.numel()) * bs
    cache = (torch.randn(slots, hkv, d, generator=gen).to(dtype),
             torch.randn(slots, hkv, d, generator=gen).to(dtype))
    q = torch.randn(t, hq, d, generator=gen).to(dtype)
    k = torch.randn(t, hkv, d, generator=gen).to(dtype)
    v = torch.randn(t, hkv, d, generator=gen).to(dtype)
    return layout, positions, cache, q, k, v, bs


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("query_lens, context_lens", [
    ([1], [0]), ([1, 1, 1], [5, 17, 33]),  # decodes
    ([4, 1, 40], [9, 30, 0]),  # drafts, a decode, a long prefill chunk (the SDPA path)
    ([20, 3], [7, 12]),
    ([24, 1, 33], [0, 8, 50]),  # two long chunks: a fresh prompt and one after its context
])
def test_cpu_backend_matches_torch_backend(dtype, query_lens, context_lens):
    layout, positions, cache, q, k, v, bs = random_batch(dtype, query_lens, context_lens)
    scale = 64 ** -0.5
    ref_cache = tuple(c.clone() for c in cache)
    ref = TorchPagedAttention()
    ref_out = ref.forward(q, k, v, ref_cache, ref.build_metadata(layout, positions, bs), scale)
    cpu = CpuPagedAttention()
    out = cpu.forward(q, k, v, cache, cpu.build_metadata(layout, positions, bs), scale)
    close(out, ref_out, dtype)
    slots = slot_mapping_for(layout, positions, bs)
    assert torch.equal(cache[0][slots], k) and torch.equal(cache[1][slots], v)


needs_bf16_dot = pytest.mark.skipif(
    not (cpu_kernels.load() and torch.ops.kiln.has_bf16_attention()),
    reason="built without AVX512-BF16")


class Bf16Case:
    """A random bf16 batch, the cpu backend's metadata for it, and its exact fp32 attention."""

    def __init__(self, query_lens, context_lens, hq, hkv, d):
        self.layout, self.positions, cache, q, k, v, self.bs = random_batch(
            torch.bfloat16, query_lens, context_lens, hq=hq, hkv=hkv, d=d)
        self.inputs = (q, k, v, cache)
        self.scale = d ** -0.5
        self.cpu = CpuPagedAttention()
        self.meta = self.cpu.build_metadata(self.layout, self.positions, self.bs)

    def exact(self) -> torch.Tensor:
        """fp32 reference attention of the same (bf16) inputs, on a copy of the cache."""
        q, k, v, cache = self.inputs
        ref = TorchPagedAttention()
        return ref.forward(q.float(), k.float(), v.float(), tuple(c.float() for c in cache),
                           ref.build_metadata(self.layout, self.positions, self.bs), self.scale)


@needs_bf16_dot
@pytest.mark.parametrize("hq, hkv, d", [(9, 3, 64), (4, 4, 128), (8, 1, 64)])
@pytest.mark.parametrize("query_lens, context_lens", [
    ([1], [37]),  # one sequence: a job per kv head and slice of its group of query heads
    ([1] * 9, [0, 1, 15, 16, 17, 40, 63, 64, 200]),  # many: a job per sequence, all its heads
    ([3, 1, 16, 1, 1], [20, 5, 33, 0, 90]),  # drafts and a 16-token query among decodes
    ([13], [150]),  # a verify step at batch 1: jobs per kv head and slice of the query
])
@pytest.mark.parametrize("threads", [1, 2])
def test_bf16_decode_kernel_matches_fp32_attention(hq, hkv, d, query_lens, context_lens,
                                                   threads):
    """Short queries on bf16 caches (dot products along the head dim, 16 keys reduced at
    once, rows touched before use) against exact fp32 attention of the same inputs."""
    case = Bf16Case(query_lens, context_lens, hq, hkv, d)
    cpu, meta, (q, k, v, cache), scale = case.cpu, case.meta, case.inputs, case.scale
    assert meta.long is None
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = cpu.forward(q, k, v, cache, meta, scale)
    finally:
        torch.set_num_threads(before)
    exact = case.exact()
    torch.testing.assert_close(out.float(), exact, atol=1e-2, rtol=1e-2)


@needs_bf16_dot
@pytest.mark.parametrize("hq, hkv, d", [(9, 3, 64), (4, 4, 128), (8, 1, 64)])
@pytest.mark.parametrize("query_lens, context_lens", [
    ([17], [0]),  # just past the short-query kernel
    ([300, 33, 70], [0, 129, 1]),  # several tiles; odd lengths; a context not on a block edge
    ([1024], [0]),
])
def test_bf16_prefill_kernel_matches_fp32_attention(hq, hkv, d, query_lens, context_lens):
    """The long-query kernel (bf16 pairs into fp32 dot products) against exact fp32 attention
    of the same bf16 inputs, and no further from it than torch's own bf16 SDPA."""
    case = Bf16Case(query_lens, context_lens, hq, hkv, d)
    cpu, meta, (q, k, v, cache), scale = case.cpu, case.meta, case.inputs, case.scale
    assert meta.short is None
    out = cpu.forward(q, k, v, cache, meta, scale)
    cpu.bf16_prefill = False  # the SDPA path on the same inputs
    sdpa = cpu.forward(q, k, v, cache, meta, scale)
    exact = case.exact()
    err = (out.float() - exact).abs().max().item()
    assert err < 2e-2
    assert err <= 2 * (sdpa.float() - exact).abs().max().item() + 1e-3


def tree_attention_reference(q, cache, layout, bs, scale):
    """Each token attends its context and, in its own query block, the tokens its tree bits
    name (causal where it has none): written out one token at a time."""
    k_cache, v_cache = (c.float() for c in cache)
    out = torch.empty(q.shape[0], q.shape[1] * q.shape[2])
    group = q.shape[1] // k_cache.shape[1]
    for s in range(len(layout.query_lens)):
        start, n, ctx = (int(layout.query_start[s]), int(layout.query_lens[s]),
                         int(layout.context_lens[s]))
        pos = torch.arange(ctx + n)
        slots = layout.block_table[s][pos // bs] * bs + pos % bs
        for i in range(n):
            bits = int(layout.tree_mask[start + i])
            seen = [j for j in range(ctx + n) if j < ctx or (
                (bits >> (j - ctx)) & 1 if bits else j - ctx <= i)]
            keys = k_cache[slots[seen]].repeat_interleave(group, 1)  # [K, Hq, D]
            values = v_cache[slots[seen]].repeat_interleave(group, 1)
            weights = torch.einsum("hd,khd->hk", q[start + i].float() * scale, keys).softmax(-1)
            out[start + i] = torch.einsum("hk,khd->hd", weights, values).reshape(-1)
    return out


def assert_both_backends_follow_the_bits(dtype, layout, positions, cache, q, k, v, bs):
    scale = 64 ** -0.5
    for backend in (TorchPagedAttention(), CpuPagedAttention()):
        run_cache = tuple(c.clone() for c in cache)
        out = backend.forward(q, k, v, run_cache, backend.build_metadata(layout, positions, bs),
                              scale)
        expected = tree_attention_reference(q, run_cache, layout, bs, scale)
        torch.testing.assert_close(out.float(), expected, atol=TOL[dtype] * 5,
                                   rtol=TOL[dtype] * 5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq, hkv", [(6, 2), (9, 3)])
def test_tree_masks_in_both_backends(dtype, hq, hkv):
    """Draft trees: a root and 6 drafts (two branches of 3, one branch of a branch), beside a
    plain decode and a plain 3-draft chain; both backends against the written-out rule."""
    layout, positions, cache, q, k, v, bs = random_batch(dtype, [7, 1, 4], [21, 9, 40],
                                                         hq=hq, hkv=hkv)
    parents = [-1, 0, 1, -1, 3, 4]  # nodes 1..6 of the first sequence (0 is the root)
    bits = [1]
    for p in parents:
        bits.append(bits[p + 1] | 1 << len(bits))
    layout.tree_mask = torch.zeros(12, dtype=torch.int64)
    layout.tree_mask[:7] = torch.tensor(bits)
    assert_both_backends_follow_the_bits(dtype, layout, positions, cache, q, k, v, bs)


def _on_one_and_two_threads(layout, positions, cache, q, k, v, bs):
    """The cpu backend's output on 1 and on 2 threads (each on its own copy of the cache), and
    the second run's cache."""
    cpu, outs = CpuPagedAttention(), []
    meta = cpu.build_metadata(layout, positions, bs)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            run_cache = tuple(c.clone() for c in cache)
            outs.append(cpu.forward(q, k, v, run_cache, meta, 64 ** -0.5))
    finally:
        torch.set_num_threads(before)
    return outs, run_cache


@needs_bf16_dot
@pytest.mark.parametrize("hq, hkv", [(9, 3), (8, 1)])
def test_a_decode_split_over_query_heads_is_the_same_to_the_bit(hq, hkv):
    """At batch 1 a single-token query whose kv heads do not share out over 2 threads is split
    by query heads within each kv head's group (3 kv heads: 4 rows against 5; 1 kv head: 4 and
    4): each row's arithmetic is its own, so 1 and 2 threads give the same bits."""
    layout, positions, cache, q, k, v, bs = random_batch(torch.bfloat16, [1], [300],
                                                         hq=hq, hkv=hkv)
    outs, _ = _on_one_and_two_threads(layout, positions, cache, q, k, v, bs)
    assert torch.equal(outs[0], outs[1])
    case_ref = TorchPagedAttention()
    ref = case_ref.forward(q.float(), k.float(), v.float(), tuple(c.float() for c in cache),
                           case_ref.build_metadata(layout, positions, bs), 64 ** -0.5)
    torch.testing.assert_close(outs[1].float(), ref, atol=1e-2, rtol=1e-2)


@needs_bf16_dot
@pytest.mark.parametrize("n", [5, 13])
def test_a_tree_split_over_threads_is_the_same_to_the_bit(n):
    """At batch 1 with 3 kv heads on 2 threads the bf16 kernel splits a tree's query tokens
    between jobs: each token's arithmetic is its own, so 1 and 2 threads give the same bits,
    and both follow the tree's bits. With 5 tokens one thread's job has 15 rows per kv head,
    which read V converted to fp32 once, while two threads' jobs have 6 (V converted per
    block of rows) and 9: the same sums either way."""
    layout, positions, cache, q, k, v, bs = random_batch(torch.bfloat16, [n], [150],
                                                         hq=9, hkv=3)
    gen = torch.Generator().manual_seed(5)
    bits = [1]
    for i in range(1, n):
        bits.append(bits[int(torch.randint(i, (1,), generator=gen))] | 1 << i)
    layout.tree_mask = torch.tensor(bits)
    outs, run_cache = _on_one_and_two_threads(layout, positions, cache, q, k, v, bs)
    assert torch.equal(outs[0], outs[1])
    expected = tree_attention_reference(q, run_cache, layout, bs, 64 ** -0.5)
    torch.testing.assert_close(outs[1].float(), expected, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_trees_longer_than_the_short_kernels_chunks_keep_their_bits(dtype):
    """A 32-token tree query (a root, 31 drafts: the most a tree holds) goes to the short
    kernel for its bits, while a 20-token prefill chunk beside it stays causal on the long
    path; both backends against the written-out rule."""
    from kiln.config_speculative import MAX_TREE_DRAFTS

    n = MAX_TREE_DRAFTS + 1
    layout, positions, cache, q, k, v, bs = random_batch(dtype, [n, 20, 1], [13, 9, 30],
                                                         hq=9, hkv=3)
    gen = torch.Generator().manual_seed(3)
    bits = [1]
    for i in range(1, n):  # each node's parent: the root or an earlier node, at random
        bits.append(bits[int(torch.randint(i, (1,), generator=gen))] | 1 << i)
    layout.tree_mask = torch.zeros(n + 21, dtype=torch.int64)
    layout.tree_mask[:n] = torch.tensor(bits)
    cpu = CpuPagedAttention()
    meta = cpu.build_metadata(layout, positions, bs)
    assert meta.short.query_lens.tolist() == [n, 1] and meta.long.query_lens.tolist() == [20]
    assert_both_backends_follow_the_bits(dtype, layout, positions, cache, q, k, v, bs)
