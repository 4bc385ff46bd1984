"""MLA's attention in both backends (`forward_latent`): one shared head R + P wide whose values
are its first R columns, over paged rows, against the rule written out one token at a time —
decodes, draft chains and trees, and long prefill chunks after a context."""

from __future__ import annotations

import pytest
import torch

from kiln.runner.attention import CpuPagedAttention, TorchPagedAttention, slot_mapping_for
from tests.kernels.common import needs_cpu_kernels
from tests.kernels.test_attention import random_batch

HEADS, LATENT, ROPE = 4, 16, 8  # H, R, P


def latent_batch(query_lens, context_lens):
    """random_batch's layout over a latent cache [slots, 1, R + P], queries [T, H, R + P]."""
    layout, positions, _, _, _, _, bs = random_batch(torch.float32, query_lens, context_lens)
    gen = torch.Generator().manual_seed(1)
    slots = int(layout.block_table.max() + 4) * bs
    cache = torch.randn(slots, 1, LATENT + ROPE, generator=gen)
    q = torch.randn(len(positions), HEADS, LATENT + ROPE, generator=gen)
    kv = torch.randn(len(positions), 1, LATENT + ROPE, generator=gen)
    return layout, positions, cache, q, kv, bs


def reference(q, cache, layout, bs, scale):
    """Token by token: its context and, in its own query block, the tokens its tree bits name
    (causal without bits); scores over whole rows, values their first R columns."""
    out = torch.empty(q.shape[0], HEADS * LATENT)
    tree = layout.tree_mask
    for s in range(len(layout.query_lens)):
        start, n, ctx = (int(layout.query_start[s]), int(layout.query_lens[s]),
                         int(layout.context_lens[s]))
        pos = torch.arange(ctx + n)
        rows = cache[layout.block_table[s][pos // bs] * bs + pos % bs, 0]  # [K, R + P]
        for i in range(n):
            bits = int(tree[start + i]) if tree is not None else 0
            seen = [j for j in range(ctx + n) if j < ctx or (
                (bits >> (j - ctx)) & 1 if bits else j - ctx <= i)]
            weights = (q[start + i] @ rows[seen].T * scale).softmax(-1)  # [H, K]
            out[start + i] = (weights @ rows[seen, :LATENT]).reshape(-1)
    return out


BACKENDS = [pytest.param(TorchPagedAttention, id="torch"),
            pytest.param(CpuPagedAttention, id="cpu", marks=needs_cpu_kernels)]


@pytest.mark.parametrize("backend_cls", BACKENDS)
@pytest.mark.parametrize("query_lens, context_lens", [
    ([1, 1, 1], [5, 17, 33]),  # decodes
    ([4, 1, 40], [9, 30, 0]),  # drafts, a decode, a long prefill chunk
    ([24, 3], [8, 12]),  # a long chunk after its context
])
def test_latent_attention_follows_the_rule(backend_cls, query_lens, context_lens):
    layout, positions, cache, q, kv, bs = latent_batch(query_lens, context_lens)
    backend, scale = backend_cls(), (LATENT + ROPE) ** -0.5
    out = backend.forward_latent(q, kv, (cache,), backend.build_metadata(layout, positions, bs),
                                 scale, LATENT)
    assert torch.equal(cache[slot_mapping_for(layout, positions, bs)], kv)  # written first
    torch.testing.assert_close(out, reference(q, cache, layout, bs, scale), atol=1e-5,
                               rtol=1e-5)


@pytest.mark.parametrize("backend_cls", BACKENDS)
def test_latent_attention_follows_draft_tree_bits(backend_cls):
    """A root and 6 drafts in two branches beside a plain decode and a 3-draft chain."""
    layout, positions, cache, q, kv, bs = latent_batch([7, 1, 4], [21, 9, 40])
    bits = [1]
    for parent in [-1, 0, 1, -1, 3, 4]:
        bits.append(bits[parent + 1] | 1 << len(bits))
    layout.tree_mask = torch.zeros(12, dtype=torch.int64)
    layout.tree_mask[:7] = torch.tensor(bits)
    backend, scale = backend_cls(), (LATENT + ROPE) ** -0.5
    out = backend.forward_latent(q, kv, (cache,), backend.build_metadata(layout, positions, bs),
                                 scale, LATENT)
    torch.testing.assert_close(out, reference(q, cache, layout, bs, scale), atol=1e-5,
                               rtol=1e-5)
