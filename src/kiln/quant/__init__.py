"""Quantized weights: formats with real packed storage, and the linear methods that serve them.

Importing this package registers every format (`get_format("nvfp4")`) and, for each, a linear
method under the same name plus a "-dyn" twin with per-token activation quantization
(`kiln.models.layers.linear.get_linear_method("int4-g32-asym")`).
"""

from kiln.quant import microscaling  # noqa: F401  (registers nvfp4, mxfp4)
from kiln.quant.formats import (
    StoredTensor,
    WeightFormat,
    available_formats,
    get_format,
    register_format,
)
from kiln.quant.linear import (
    DYNAMIC_SUFFIX,
    Int4LinearMethod,
    Int8LinearMethod,
    QuantLinearMethod,
)

__all__ = [
    "DYNAMIC_SUFFIX",
    "Int4LinearMethod",
    "Int8LinearMethod",
    "QuantLinearMethod",
    "StoredTensor",
    "WeightFormat",
    "available_formats",
    "get_format",
    "register_format",
]
