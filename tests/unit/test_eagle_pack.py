"""The head packed for inference (fused q/k/v and gate/up, the target's ops) computes what
the plain head computes."""

from __future__ import annotations

import copy

import pytest
import torch

from kiln.models.layers.ops import get_ops
from kiln.spec.eagle import EagleHead, HeadConfig, pack_for_inference


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
