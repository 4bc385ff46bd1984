"""Elementwise model ops: the plain torch reference and the fused C++ kernels beside it.

`TorchOps` is the reference (and what fp32 parity tests run); `KernelOps` calls the fused
kernels in kiln/kernels/cpu (one pass over memory instead of several torch ops each). A
model gets one `ModelOps` object and calls it; nothing else changes between the two paths.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class TorchOps:
    """Reference implementations (HF semantics: normalize in fp32, round, then scale)."""

    name = "torch"

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


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class KernelOps(TorchOps):
    """Fused C++ kernels (fp32 math, one rounding); requires `kiln.kernels.cpu.load()`."""

    name = "kernels"

    def rms_norm(self, x, weight, eps):
        return torch.ops.kiln.rms_norm(x, weight, eps)

    def add_rms_norm(self, x, residual, weight, eps):
        residual = residual.contiguous()
        normed = torch.ops.kiln.add_rms_norm(x, residual, weight, eps)  # residual += x
        return normed, residual

    def silu_mul(self, gate_up):
        return torch.ops.kiln.silu_mul(gate_up)


def get_ops(name: str) -> TorchOps:
    """"torch" (reference), "kernels" (C++), or "auto" (kernels where they build)."""
    if name == "torch":
        return TorchOps()
    from kiln.kernels import cpu as cpu_kernels

    if cpu_kernels.load():
        return KernelOps()
    if name == "kernels":
        raise RuntimeError("the kiln CPU kernels could not be built (see the log)")
    return TorchOps()
