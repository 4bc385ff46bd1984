"""Dense bf16 linear layers on oneDNN's prepacked weights (the fast CPU path).

torch's generic bf16 matrix-vector product reads weights at a fraction of the memory bandwidth
on AVX-512 CPUs; oneDNN's prepacked layout feeds the bf16 dot-product instructions directly and
is as fast or faster at every batch size we measured (BENCHMARKS.md). The plain weight stays
next to the packed copy so the reference path (DenseLinearMethod) and weight export keep
working; the packed copy is what the forward pass reads.
"""

from __future__ import annotations

import logging

import torch

from kiln.models.layers.linear import DenseLinearMethod, register_linear_method

log = logging.getLogger(__name__)


def onednn_available(dtype: torch.dtype) -> bool:
    """oneDNN prepacking works for bf16 weights on CPUs with mkldnn support."""
    if dtype != torch.bfloat16 or not torch.backends.mkldnn.is_available():
        return False
    try:
        w = torch.ones(8, 8, dtype=dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 1)
        out = torch.ops.mkldnn._linear_pointwise(torch.ones(1, 8, dtype=dtype), packed, None,
                                                 "none", [], "")
        return bool(out[0, 0] == 8)
    except (RuntimeError, AttributeError) as exc:
        log.info("oneDNN linear unavailable (%s); using torch's reference matmul", exc)
        return False


@register_linear_method("dense-onednn")
class OneDNNLinearMethod(DenseLinearMethod):
    """DenseLinearMethod whose forward reads a oneDNN-prepacked copy made at finalize."""

    def finalize(self, layer):
        layer.packed_weight = torch.ops.mkldnn._reorder_linear_weight(layer.weight.data, 1)

    def apply(self, layer, x):
        if x.dim() == 2:  # the engine's flat batch: no reshapes (each op call costs ~1 us)
            return torch.ops.mkldnn._linear_pointwise(x, layer.packed_weight, layer.bias,
                                                      "none", [], "")
        shape = x.shape
        out = torch.ops.mkldnn._linear_pointwise(
            x.reshape(-1, shape[-1]), layer.packed_weight, layer.bias, "none", [], "")
        return out.reshape(*shape[:-1], out.shape[-1])
