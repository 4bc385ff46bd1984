"""Dense bf16 linear layers on kiln's VNNI-packed weights (AVX512-BF16 CPUs without AMX).

One packed copy serves every step size: decode streams it front to back at close to the
memory bandwidth (oneDNN's bf16 linear reached about half of it at one token), prefill runs
the same kernel's 8-token tiles at oneDNN's speed or better (docs/decisions/0013). The plain
weight is released once packed; `dense_weight` unpacks a copy for the few readers that want W.
Decoder layers whose shape does not split into blocks of 16 rows keep oneDNN's packing (the
fused decoder stack reads a packed layer's row count from its blocks); the LM head
(`dense-vnni-head`) is packed whatever its rows, its last block zero-padded, since it runs
outside the stack and a oneDNN-packed head would be unpacked every step to write fp32 logits.
"""

from __future__ import annotations

import torch
from torch import nn

from kiln.kernels.bf16_vnni import BLOCK, pack_vnni, unpack_vnni, vnni_mm
from kiln.models.layers.linear import NO_SCALE, StackTensors, register_linear_method
from kiln.models.layers.onednn import OneDNNLinearMethod


@register_linear_method("dense-vnni")
class VnniLinearMethod(OneDNNLinearMethod):
    """OneDNNLinearMethod whose weights are VNNI-packed for kiln's kernel (where N % 16 == 0)."""

    any_rows = False  # pack a weight whose rows are not a multiple of 16 (the LM head)

    def finalize(self, layer):
        weight = layer.weight.data
        if weight.dtype != torch.bfloat16 or (weight.shape[0] % BLOCK and not self.any_rows):
            return super().finalize(layer)
        layer.vnni_weight = pack_vnni(weight)
        layer.weight = nn.Parameter(weight.new_empty(0, weight.shape[1]), requires_grad=False)

    def dense_weight(self, layer) -> torch.Tensor:
        if not hasattr(layer, "vnni_weight"):
            return super().dense_weight(layer)
        return unpack_vnni(layer.vnni_weight, layer.out_features, layer.in_features)

    def apply(self, layer, x):
        if not hasattr(layer, "vnni_weight"):
            return super().apply(layer, x)
        if x.dtype != torch.bfloat16:  # the model runs in bf16; anything else is a caller's test
            return torch.nn.functional.linear(x, self.dense_weight(layer).to(x.dtype),
                                              layer.bias)
        flat = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        if layer.bias is None:
            out = vnni_mm(flat, layer.vnni_weight, layer.out_features)
        else:  # the bias joins the fp32 sum: one rounding
            out = (vnni_mm(flat, layer.vnni_weight, layer.out_features, fp32_out=True)
                   + layer.bias.float()).to(x.dtype)
        return out if x.dim() == 2 else out.reshape(*x.shape[:-1], out.shape[-1])

    def apply_fp32(self, layer, x):
        if not hasattr(layer, "vnni_weight") or x.dtype != torch.bfloat16:
            return super().apply_fp32(layer, x)
        flat = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        out = vnni_mm(flat, layer.vnni_weight, layer.out_features, fp32_out=True)
        if layer.bias is not None:
            out = out + layer.bias.float()
        return out if x.dim() == 2 else out.reshape(*x.shape[:-1], out.shape[-1])

    def stack_tensors(self, layer) -> StackTensors | None:
        if not hasattr(layer, "vnni_weight"):
            return super().stack_tensors(layer)
        if layer.bias is not None or layer.out_features % BLOCK:  # the stack: whole blocks only
            return None
        return StackTensors(layer.vnni_weight, NO_SCALE)


@register_linear_method("dense-vnni-head")
class VnniHeadMethod(VnniLinearMethod):
    """The LM head on kiln's VNNI kernel whatever its vocabulary size (kiln.models.loader)."""

    any_rows = True
