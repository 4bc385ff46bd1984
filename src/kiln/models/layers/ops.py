"""Elementwise model ops: the plain torch reference and the fused C++ (and Triton) kernels
beside it.

`TorchOps` is the reference (and what fp32 parity tests run); `KernelOps` calls the fused
kernels in kiln/kernels/cpu (one pass over memory instead of several torch ops each), and
`TritonOps` the GPU's (kiln/kernels/triton). A model gets the ops object of its platform's
kernel set (`ops_for`) and calls it; nothing else changes between the paths.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.models.layers.rotary import RotaryEmbedding
from kiln.platform import KernelSet, resolve_kernel_set


class TorchOps:
    """Reference implementations (HF semantics: normalize in fp32, round, then scale)."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        return weight * x32.to(x.dtype)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(residual + x), residual + x)."""
        residual = residual + x
        return self.rms_norm(residual, weight, eps), residual

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def rotary(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
               cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, Hq, D], k: [T, Hkv, D]; cos/sin: [max_pos, D] in the activation dtype."""
        c = cos[positions].unsqueeze(1)
        s = sin[positions].unsqueeze(1)
        return q * c + _rotate_half(q) * s, k * c + _rotate_half(k) * s

    def rotary_qkv(self, qkv: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding,
                   num_heads: int, num_kv_heads: int) -> tuple[torch.Tensor, ...]:
        """q [T, Hq, D], k and v [T, Hkv, D] of the fused projection's output
        [T, (Hq + 2 Hkv) * D], q and k rotated (by the tables in the activation dtype)."""
        q, k, v = split_heads(qkv, num_heads, num_kv_heads)
        q, k = self.rotary(q, k, positions, rotary.cos, rotary.sin)
        return q, k, v

    def qk_norm_rotary_qkv(self, qkv: torch.Tensor, positions: torch.Tensor,
                           rotary: RotaryEmbedding, q_weight: torch.Tensor,
                           k_weight: torch.Tensor, eps: float, num_heads: int,
                           num_kv_heads: int) -> tuple[torch.Tensor, ...]:
        """Qwen3's attention input: q [T, Hq, D], k and v [T, Hkv, D] of the fused
        projection's output, q and k each RMS-normed per head (HF's q_norm / k_norm, the torch
        reference norm) and then rotated (`self.rotary`, tables in the activation dtype)."""
        q, k, v = split_heads(qkv, num_heads, num_kv_heads)
        q, k = self.rotary(TorchOps.rms_norm(self, q, q_weight, eps),
                           TorchOps.rms_norm(self, k, k_weight, eps), positions, rotary.cos,
                           rotary.sin)
        return q, k, v


def split_heads(qkv: torch.Tensor, num_heads: int,
                num_kv_heads: int) -> tuple[torch.Tensor, ...]:
    """Views [T, H, D] of the q, k and v parts of a fused projection's output."""
    head_dim = qkv.shape[-1] // (num_heads + 2 * num_kv_heads)
    q, k, v = qkv.split((num_heads * head_dim, num_kv_heads * head_dim,
                         num_kv_heads * head_dim), dim=-1)
    return (q.view(-1, num_heads, head_dim), k.view(-1, num_kv_heads, head_dim),
            v.view(-1, num_kv_heads, head_dim))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class KernelOps(TorchOps):
    """Fused C++ kernels (fp32 math, one rounding); requires `kiln.kernels.cpu.load()`."""

    def rms_norm(self, x, weight, eps):
        return torch.ops.kiln.rms_norm(x, weight, eps)

    def add_rms_norm(self, x, residual, weight, eps):
        residual = residual.contiguous()
        normed = torch.ops.kiln.add_rms_norm(x, residual, weight, eps)  # residual += x
        return normed, residual

    def silu_mul(self, gate_up):
        return torch.ops.kiln.silu_mul(gate_up)

    def rotary_qkv(self, qkv, positions, rotary, num_heads, num_kv_heads):
        """Rotated in place inside qkv by one C++ call (fp32 tables, one rounding)."""
        rotary.apply_inplace(qkv, positions, num_heads, num_kv_heads)
        return split_heads(qkv, num_heads, num_kv_heads)

    def qk_norm_rotary_qkv(self, qkv, positions, rotary, q_weight, k_weight, eps, num_heads,
                           num_kv_heads):
        """Normed and rotated in place inside qkv by one C++ call: the norm as `rms_norm`
        rounds it, the rotation as `rotary_qkv` (fp32 tables, one rounding); the fused
        decoder stack calls the same kernel."""
        torch.ops.kiln.qk_norm_rotary_inplace(qkv, positions, q_weight, k_weight, eps,
                                              rotary.cos32, rotary.sin32, num_heads,
                                              num_kv_heads, rotary.cos32.shape[-1])
        return split_heads(qkv, num_heads, num_kv_heads)


class TritonOps(TorchOps):
    """kiln's Triton kernels (kiln.kernels.triton; a GPU, or Triton's interpreter on the
    CPU): one launch each for the norms and the rotation (fp32 tables, one rounding) instead
    of several torch ops; SiLU-and-multiply stays torch."""

    def __init__(self):
        from kiln.kernels.triton import norm_rotary  # needs triton: imported when chosen

        self.kernels = norm_rotary

    def rms_norm(self, x, weight, eps):
        return self.kernels.rms_norm(x, weight, eps)

    def add_rms_norm(self, x, residual, weight, eps):
        return self.kernels.fused_add_rms_norm(x, residual.contiguous(), weight, eps)

    def rotary_qkv(self, qkv, positions, rotary, num_heads, num_kv_heads):
        """Rotated in place inside qkv by one kernel."""
        self.kernels.rotary_inplace(qkv, positions, rotary.cos32, rotary.sin32, num_heads,
                                    num_kv_heads)
        return split_heads(qkv, num_heads, num_kv_heads)


def ops_for(kernels: KernelSet) -> TorchOps:
    """The ops object of a platform's kernel set."""
    if kernels is KernelSet.TRITON:
        return TritonOps()
    return KernelOps() if kernels is KernelSet.CPP else TorchOps()


def get_ops(name: str) -> TorchOps:
    """"torch" (reference), "cpp" (C++, must build), or "auto" (C++ where it builds)."""
    return ops_for(resolve_kernel_set(name))
