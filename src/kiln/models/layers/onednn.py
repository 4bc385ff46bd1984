"""Dense bf16 linear layers on oneDNN's prepacked weights (the fast CPU path).

torch's generic bf16 matrix-vector product reads weights at a fraction of the memory bandwidth
on AVX-512 CPUs; oneDNN's prepacked layout feeds the bf16 dot-product instructions directly and
is as fast or faster at every batch size we measured (docs/decisions/0001). Once packed, the plain
weight is released (the model is held once, not twice); `dense_weight(layer)` unpacks a copy for
the few readers that want W itself (speculator heads reading LM head rows, quantization, tests).
Whether it runs here: kiln.kernels.bf16_mm.onednn_available. oneDNN picks its kernel for the
CPU at every token count: AVX512-BF16 dot products on Zen 4, AMX tiles on Xeons that have them
(the packed layout is the one both read; tests/kernels/test_amx_dispatch.py checks which kernel
runs and that no call repacks the weight; docs/decisions/0011). On AVX512-BF16 CPUs without
AMX the loader picks kiln's VNNI-packed kernel instead (models/layers/vnni.py: oneDNN's
one-token product read weights at about half the bandwidth there; docs/decisions/0013).
"""

from __future__ import annotations

import torch
from torch import nn

from kiln.models.layers.linear import (
    NO_SCALE,
    DenseLinearMethod,
    StackTensors,
    register_linear_method,
)


@register_linear_method("dense-onednn")
class OneDNNLinearMethod(DenseLinearMethod):
    """DenseLinearMethod whose forward reads a oneDNN-prepacked copy made at finalize."""

    def finalize(self, layer):
        weight = layer.weight.data
        layer.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
        # released: an empty [0, in] stand-in, so a stray read fails loudly
        layer.weight = nn.Parameter(weight.new_empty(0, weight.shape[1]), requires_grad=False)

    def dense_weight(self, layer) -> torch.Tensor:
        return layer.packed_weight.to_dense()

    def apply(self, layer, x):
        if x.dim() == 2:  # the engine's flat batch: no reshapes (each op call costs ~1 us)
            return torch.ops.mkldnn._linear_pointwise(x, layer.packed_weight, layer.bias,
                                                      "none", [], "")
        shape = x.shape
        out = torch.ops.mkldnn._linear_pointwise(
            x.reshape(-1, shape[-1]), layer.packed_weight, layer.bias, "none", [], "")
        return out.reshape(*shape[:-1], out.shape[-1])

    def stack_tensors(self, layer) -> StackTensors | None:
        if layer.bias is not None or not hasattr(layer, "packed_weight"):
            return None
        return StackTensors(layer.packed_weight, NO_SCALE)
