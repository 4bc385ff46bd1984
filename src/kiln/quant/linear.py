"""Quantized linear methods: packed weights behind kiln.models.layers.linear's seam.

One method per format, registered under the format's name ("int8", "fp8", "int4-g128-sym",
"nvfp4", "mxfp4", ...; see kiln.quant.formats). A name with the suffix "-dyn" also quantizes
activations dynamically, per token, in the same format ("int8-dyn" is W8A8 with an exact int32
accumulation; "nvfp4-dyn", "mxfp4-dyn" and "int4-g32-sym-dyn" are W4A4), which reproduces
those schemes' numerics on CPU. NVFP4 activations get a global scale per token here, where
deployments often calibrate one per tensor.

Loading (`load_shard(layer, shard, name, tensor)`):
  - "weight" with a float dtype (fp16/bf16/fp32) is quantized on load, so a dense HF
    checkpoint is served quantized. Each shard of a fused layer is quantized on its own.
  - Any stored tensor of the format ("weight" int8/fp8, "weight_packed", "weight_scale",
    "weight_min", "weight_global_scale") is copied into the shard's rows as is. Codes must
    arrive in their stored dtype; float scales may arrive in any float dtype, and a per-channel
    scale may arrive as one per-tensor scalar (broadcast to the shard's rows).
  - "bias" is kept dense in the model dtype.
Per-tensor scalars (NVFP4's global scale) are kept once per shard: buffer [n_shards], expanded
to one per output row at `finalize`, so fused q/k/v with different global scales stay exact.

Compute: the reference path dequantizes the weight in row tiles of at most `tile_elements`
values and multiplies in the activation dtype. Nothing dequantized is cached between calls:
a cache would give the memory saving back, so each call pays the dequantization (which
dominates at batch 1). int8 uses kiln's or torch's int8 kernels where kiln.kernels.quant_mm
has one; int4 (both variants) is repacked at `finalize` into the layout of torch's CPU int4
kernel, which serves bf16/fp16 activations at small token counts (see Int4LinearMethod).
With the Triton kernel set (a CUDA platform, or Triton's interpreter in tests: `use_kernels`),
weight-only int8 and fp8 steps of at most `quant_gemv.MAX_ROWS` rows run kiln's Triton GEMV
(kiln.kernels.triton.quant_gemv: codes widened in registers, the row scale applied once);
larger steps keep the paths above (on a GPU: dequantize + cuBLAS).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Sequence
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from kiln.kernels.bf16_mm import bf16_matmul_emulated
from kiln.kernels.int8_vnni import (
    int8_vnni_mm,
    int8_vnni_unsupported,
    pack_int8_vnni,
    unpack_int8_vnni,
)
from kiln.kernels.quant_mm import (
    INT8_GEMV_MAX_TOKENS,
    int4_kernel_group,
    int4_kernel_pack,
    int4_kernel_unavailable,
    int4_kernel_unpack,
    int4_scales_and_zeros,
    int4_weight_only_mm,
    int8_gemv_fp32,
    int8_gemv_mm,
    int8_int8_mm,
    int8_vnni_max_tokens,
    int8_vnni_serves,
    int8_vnni_wanted,
    int8_weight_only_mm,
    int8_wide_unbounded,
)
from kiln.models.layers.linear import Linear, StackTensors, register_linear_method, shard_rows
from kiln.platform import KernelSet
from kiln.quant.formats import (
    Int4Format,
    StoredTensor,
    WeightFormat,
    available_formats,
    get_format,
)
from kiln.quant.packing import pack_nibbles, unpack_nibbles
from kiln.quant.sharding import check_columns, columns_of, quantized_whole, rows_of

log = logging.getLogger(__name__)

DENSE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
DYNAMIC_SUFFIX = "-dyn"
# weight-only formats kiln.kernels.triton.quant_gemv reads as stored (codes [out, in], one
# fp32 scale per output row)
TRITON_GEMV_FORMATS = ("int8", "fp8")


class QuantLinearMethod:
    """A LinearMethod storing W in `fmt`; `act_quant` fake-quantizes activations per token."""

    def __init__(self, fmt: WeightFormat | str, act_quant: bool = False,
                 tile_elements: int = 1 << 22):
        self.fmt = get_format(fmt) if isinstance(fmt, str) else fmt
        self.act_quant = act_quant
        self.tile_elements = tile_elements
        # the most rows the Triton GEMV serves, once `use_kernels` chose it; None: never
        self.triton_gemv_rows: int | None = None

    # -- lifecycle: create, load, finalize ------------------------------------------------

    def create_weights(self, layer: Linear, in_features: int, out_shards: Sequence[int],
                       bias: bool, dtype: torch.dtype) -> None:
        if not self.fmt.supports(in_features):
            raise ValueError(f"{self.fmt.name} packs two 4-bit codes per byte and cannot "
                             f"store a layer with an odd number of inputs ({in_features})")
        out = sum(out_shards)
        layer.quant_storage = self.fmt.storage(out, in_features)
        for t in layer.quant_storage:
            shape = (len(out_shards),) if t.cols is None else (out, t.cols)
            layer.register_buffer(t.name, torch.zeros(shape, dtype=t.dtype))
        layer.bias = (nn.Parameter(torch.zeros(out, dtype=dtype), requires_grad=False)
                      if bias else None)
        layer.quant_loaded = set()  # (shard, name) pairs seen so far; checked by finalize

    def load_shard(self, layer: Linear, shard: int, name: str, tensor: torch.Tensor) -> None:
        if name == "bias":
            return self._copy_bias(layer, shard, tensor)
        if name == "weight" and tensor.dtype in DENSE_DTYPES:
            tensors = self.fmt.quantize(tensor)  # a dense checkpoint, served quantized
        else:
            tensors = {name: tensor}
        for key, value in tensors.items():
            self._copy_stored(layer, shard, key, value)

    def finalize(self, layer: Linear) -> None:
        names = [t.name for t in layer.quant_storage]
        missing = [f"shard {s}: {n}" for s in range(len(layer.out_shards)) for n in names
                   if (s, n) not in layer.quant_loaded]
        if missing:
            raise ValueError(f"{self.fmt.name} linear is missing tensors: {', '.join(missing)}")
        del layer.quant_loaded
        counts = torch.tensor(layer.out_shards)
        for t in layer.quant_storage:
            if t.cols is None:  # one scalar per shard -> one per output row
                per_row = getattr(layer, t.name).repeat_interleave(counts)  # [out]
                layer.register_buffer(f"{t.name}_per_row", per_row, persistent=False)

    def _copy_bias(self, layer: Linear, shard: int, tensor: torch.Tensor) -> None:
        if layer.bias is None:
            raise ValueError("checkpoint has a bias but the layer was built without one")
        target = layer.bias[shard_rows(layer.out_shards, shard)]
        _check_shape("bias", tensor, target.shape)
        with torch.no_grad():
            target.copy_(tensor)

    def _copy_stored(self, layer: Linear, shard: int, name: str, tensor: torch.Tensor) -> None:
        spec = _find(layer.quant_storage, name)
        if spec is None:
            raise ValueError(f"{self.fmt.name} linear has no tensor {name!r}")
        if spec.cols is None:
            target, tensor = getattr(layer, name)[shard:shard + 1], tensor.reshape(-1)
        else:
            target = getattr(layer, name)[shard_rows(layer.out_shards, shard)]
            if spec.cols == 1 and tensor.numel() == 1:  # a per-tensor scale (e.g. FP8 checkpoints)
                tensor = tensor.reshape(1, 1).expand(target.shape)
        _check_shape(name, tensor, target.shape)
        _check_dtype(name, tensor.dtype, target.dtype)
        target.copy_(tensor)
        layer.quant_loaded.add((shard, name))

    def use_kernels(self, layer: Linear, kernels: KernelSet) -> None:
        """The platform's kernel set (kiln.models.layers.linear.use_kernels, after loading):
        with Triton's, a weight-only int8 or fp8 layer sends decode-sized steps to the
        Triton GEMV. Imports triton only then."""
        if kernels is not KernelSet.TRITON or self.act_quant:
            return
        if self.fmt.name in TRITON_GEMV_FORMATS:
            from kiln.kernels.triton import quant_gemv

            self.triton_gemv_rows = quant_gemv.MAX_ROWS

    # -- compute ----------------------------------------------------------------------------

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        flat = x.dim() == 2  # the engine's flat batch: no reshapes
        x2 = x if flat else x.reshape(-1, layer.in_features)  # [M, in]
        y = self.matmul(layer, x2)                               # [M, out]
        if layer.bias is not None:
            y = y + layer.bias.to(y.dtype)
        return y if flat else y.reshape(*x.shape[:-1], layer.out_features)

    def apply_fp32(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        """`apply` on fp32 activations (bf16 ones widen exactly): fp32 outputs, never rounded
        to the model dtype (a quantized LM head's logits)."""
        return self.apply(layer, x.float())

    def matmul(self, layer: Linear, x2: torch.Tensor) -> torch.Tensor:
        """x2 [M, in] @ W^T -> [M, out]; the plain reference every speed path must match."""
        if self.takes_triton_gemv(x2):
            return triton_gemv(layer, x2)
        if self.act_quant:
            x2 = self.fmt.fake_quantize(x2)
        return self.weight_matmul(layer, x2)

    def takes_triton_gemv(self, x2: torch.Tensor) -> bool:
        return self.triton_gemv_rows is not None and x2.shape[0] <= self.triton_gemv_rows

    def weight_matmul(self, layer: Linear, x2: torch.Tensor) -> torch.Tensor:
        """x2 [M, in] @ W^T: subclasses override this with a kernel where one runs."""
        return self.dequantized_matmul(layer, x2)

    def dequantized_matmul(self, layer: Linear, x2: torch.Tensor,
                           fp32: bool = False) -> torch.Tensor:
        """x2 @ W^T, W dequantized a row tile at a time and rounded to x2's dtype; with `fp32`
        the fp32 tiles multiply x2 widened to fp32, rounded once at the end."""
        if fp32:
            tiles = [F.linear(x2.float(), self.dequantize_rows(layer, rows))
                     for rows in self.row_tiles(layer)]
        else:
            tiles = [F.linear(x2, self.dequantize_rows(layer, rows).to(x2.dtype))
                     for rows in self.row_tiles(layer)]
        y = tiles[0] if len(tiles) == 1 else torch.cat(tiles, dim=-1)
        return y.to(x2.dtype)

    def row_tiles(self, layer: Linear) -> Iterator[slice]:
        step = max(1, self.tile_elements // layer.in_features)
        for start in range(0, layer.out_features, step):
            yield slice(start, min(start + step, layer.out_features))

    def dequantize_rows(self, layer: Linear, rows: slice) -> torch.Tensor:
        """Float32 W[rows] [len(rows), in], from the stored tensors (after `finalize`)."""
        packed = {t.name: (getattr(layer, f"{t.name}_per_row") if t.cols is None
                           else self.stored(layer, t.name))[rows] for t in layer.quant_storage}
        return self.fmt.dequantize(packed)

    def stored(self, layer: Linear, name: str) -> torch.Tensor:
        """Stored tensor `name` as `storage()` defines it (subclasses may keep it repacked)."""
        return getattr(layer, name)

    def dequantize_weight(self, layer: Linear) -> torch.Tensor:
        """Float32 W [out, in]: for reference matmuls, KL evaluation and tests."""
        return self.dequantize_rows(layer, slice(0, layer.out_features))

    def shard_tensors(self, layer: Linear, shard: int) -> dict[str, torch.Tensor]:
        """One shard's stored tensors as a checkpoint holds them (the inverse of load_shard)."""
        rows = shard_rows(layer.out_shards, shard)
        out = {t.name: getattr(layer, t.name)[shard:shard + 1] if t.cols is None
               else self.stored(layer, t.name)[rows] for t in layer.quant_storage}
        if layer.bias is not None:
            out["bias"] = layer.bias[rows]
        return {name: t.clone() for name, t in out.items()}

    def stack_tensors(self, layer: Linear) -> StackTensors | None:
        return None  # the fused stack reads weight-only int8 only (Int8LinearMethod)

    # -- tensor parallelism (kiln.models.layers.parallel; the rules: kiln.quant.sharding) ----

    def rank_rows(self, name: str, tensor: torch.Tensor, rows: slice,
                  size: int) -> dict[str, torch.Tensor]:
        """A checkpoint tensor's stored tensors for output rows `rows` (`size` of them, zero
        rows past the end): a column-parallel rank's part."""
        whole = quantized_whole(self.fmt, name, tensor, DENSE_DTYPES)
        return {key: rows_of(self.fmt, key, value, rows, size) for key, value in whole.items()}

    def rank_columns(self, name: str, tensor: torch.Tensor,
                     cols: slice) -> dict[str, torch.Tensor]:
        """A checkpoint tensor's stored tensors for input columns `cols` (whole groups): a
        row-parallel rank's part."""
        whole = quantized_whole(self.fmt, name, tensor, DENSE_DTYPES)
        return {key: columns_of(self.fmt, key, value, cols) for key, value in whole.items()}

    def check_rank_columns(self, world: int, in_features: int | None = None) -> None:
        """ValueError where a layer of `in_features` inputs cannot split into `world` column
        ranges with one process's numbers (None: the checks that hold for any size)."""
        check_columns(self.fmt, self.act_quant, world, in_features)


class Int8LinearMethod(QuantLinearMethod):
    """int8 weights: int8 kernels where they are fast, the reference path otherwise.

    Weight-only, on CPUs with AVX512-VNNI (`int8_vnni_wanted`): at `finalize` the codes move
    into kiln's VNNI layout (`int8_vnni_weight`, uint8 [out/16, in/4, 16, 4]; `weight` is left
    empty, so the weights are held once, and `stored` unpacks them exactly for export,
    sharding and `dequantize_weight`); kiln's `int8_vnni_mm` serves up to
    `int8_vnni_max_tokens()` tokens, bf16 steps of any size where `int8_wide_unbounded()`
    (the codes widened to bf16 from `int8_wide_min_tokens()` on) and the fp32 LM head at any
    count; dequantize + matmul (oneDNN's bf16 GEMM, AMX tiles where the CPU has them) the
    rest. Elsewhere (or with KILN_INT8_VNNI=0): kiln's `int8_gemv` up to INT8_GEMV_MAX_TOKENS
    tokens (any float dtype), then torch's `_weight_int8pack_mm` for bf16/fp16 activations. With `act_quant`
    (W8A8): per-token symmetric int8 activations and an exact int32 accumulation via `_int_mm`.
    """

    def finalize(self, layer: Linear) -> None:
        super().finalize(layer)
        why = int8_vnni_unsupported(layer.out_features, layer.in_features)
        if self.act_quant or layer.weight.dtype != torch.int8 or not int8_vnni_wanted() or why:
            if why and not self.act_quant:
                _log_once(f"int8 layers keep kiln's int8_gemv: {why}")
            return
        layer.register_buffer("int8_vnni_weight", pack_int8_vnni(layer.weight))
        layer.register_buffer("weight", layer.weight.new_empty(0, layer.in_features))

    def use_kernels(self, layer: Linear, kernels: KernelSet) -> None:
        super().use_kernels(layer, kernels)
        if self.triton_gemv_rows is not None and hasattr(layer, "int8_vnni_weight"):
            self.unpack_rows(layer)  # the Triton GEMV reads plain rows

    def matmul(self, layer, x2):
        if self.takes_triton_gemv(x2):
            return triton_gemv(layer, x2)
        if self.act_quant:
            return self.w8a8_matmul(layer, x2)
        if hasattr(layer, "int8_vnni_weight"):
            if not int8_vnni_serves(x2.shape[0], x2.dtype) or x2.device.type != "cpu":
                return self.dequantized_matmul(layer, x2)
            return int8_vnni_mm(x2, layer.int8_vnni_weight, layer.weight_scale,
                                layer.out_features)
        y = int8_gemv_mm(x2, layer.weight, layer.weight_scale)
        if y is None:
            y = int8_weight_only_mm(x2, layer.weight, layer.weight_scale)
        if y is not None:
            return y
        # no bf16 arithmetic (AVX2): torch's emulated bf16 matmul made a 128-token prefill
        # 1.8 s on Zen 3; the fp32 tiles through fp32 GEMM, rounded once, take 0.33 s
        return self.dequantized_matmul(
            layer, x2, fp32=x2.dtype == torch.bfloat16 and bf16_matmul_emulated())

    def apply_fp32(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        """Weight-only: kiln's int8 kernel at any token count (fp32 sums written as fp32,
        the weights read once per 8 tokens), where the dequantized fp32 matmul would widen
        every weight each call."""
        if self.act_quant or x.dim() != 2 or self.takes_triton_gemv(x):
            return super().apply_fp32(layer, x)
        if hasattr(layer, "int8_vnni_weight") and x.device.type == "cpu":
            y = int8_vnni_mm(x, layer.int8_vnni_weight, layer.weight_scale, layer.out_features,
                             fp32_out=True)
        else:
            y = int8_gemv_fp32(x, layer.weight, layer.weight_scale)
        if y is None:
            return super().apply_fp32(layer, x)
        return y if layer.bias is None else y + layer.bias.float()

    def w8a8_matmul(self, layer: Linear, x2: torch.Tensor) -> torch.Tensor:
        xq = self.fmt.quantize(x2)  # per-token: weight int8 [M, in], weight_scale [M, 1]
        acc = int8_int8_mm(xq["weight"], layer.weight)  # int32 [M, out]
        if acc is None:
            return super().matmul(layer, x2)
        y = acc.float() * xq["weight_scale"] * layer.weight_scale.reshape(1, -1)
        return y.to(x2.dtype)

    def stored(self, layer: Linear, name: str) -> torch.Tensor:
        if name == "weight" and hasattr(layer, "int8_vnni_weight"):
            return unpack_int8_vnni(layer.int8_vnni_weight, layer.out_features,
                                    layer.in_features)
        return super().stored(layer, name)

    def dequantize_rows(self, layer: Linear, rows: slice) -> torch.Tensor:
        if not hasattr(layer, "int8_vnni_weight"):
            return super().dequantize_rows(layer, rows)
        # only the packed blocks holding `rows` are unpacked
        first, stop = rows.start // 16, -(-rows.stop // 16)
        codes = unpack_int8_vnni(layer.int8_vnni_weight[first:stop], (stop - first) * 16,
                                 layer.in_features)[rows.start - first * 16:rows.stop - first * 16]
        return self.fmt.dequantize({"weight": codes, "weight_scale": layer.weight_scale[rows]})

    def stack_tensors(self, layer: Linear) -> StackTensors | None:
        """Weight-only int8 for the stack's int8 kernels: the VNNI-packed codes (4-D, which
        the stack sends to int8_vnni_mm) or plain rows (int8_gemv), and their scales; each
        serves its kernel's token counts only."""
        if self.act_quant or layer.bias is not None:
            return None
        if hasattr(layer, "int8_vnni_weight"):
            return StackTensors(layer.int8_vnni_weight, layer.weight_scale,
                                max_tokens=int8_vnni_max_tokens(),
                                bf16_max_tokens=math.inf if int8_wide_unbounded() else None)
        if layer.weight.dtype != torch.int8:
            return None
        return StackTensors(layer.weight, layer.weight_scale, max_tokens=INT8_GEMV_MAX_TOKENS)

    def unpack_rows(self, layer: Linear) -> None:
        """Back to plain int8 rows (`int8_gemv`'s), for a kernel that reads those."""
        layer.register_buffer("weight", self.stored(layer, "weight"))
        delattr(layer, "int8_vnni_weight")


class Int4LinearMethod(QuantLinearMethod):
    """int4 (symmetric or asymmetric, any group size) on torch's CPU int4 kernel where it runs.

    At `finalize`, for bf16/fp16 models, the nibbles move into the kernel's packed layout
    (`int4_kernel_weight`, replacing `weight_packed`, so the weights are held once) with the
    kernel's scales and zeros beside them (`int4_kernel_scales`, [in / g, out, 2] in the model
    dtype; g is the largest kernel group dividing the kiln group and in_features). kiln's own
    fp16 scales (and mins) stay, so `weight_packed` can be read back exactly (`stored`) for
    export, `dequantize_weight` and the reference path, which still serves token counts past
    INT4_KERNEL_MAX_TOKENS. Where the kernel cannot run (fp32 models, older torch, shapes it
    does not take) the layer keeps the plain layout and the reference path, and says so once
    in the log.
    """

    def create_weights(self, layer, in_features, out_shards, bias, dtype):
        super().create_weights(layer, in_features, out_shards, bias, dtype)
        layer.int4_kernel_dtype = dtype

    def finalize(self, layer: Linear) -> None:
        super().finalize(layer)
        group = int4_kernel_group(self.fmt.group_size, layer.in_features, layer.out_features)
        why = int4_kernel_unavailable(layer.int4_kernel_dtype) or (
            None if group else f"a {layer.out_features}x{layer.in_features} layer with "
                               f"{self.fmt.group_size}-value groups does not fit its groups")
        if why:
            _log_once(f"int4 layers use the reference dequantize path: {why}")
            return
        symmetric = self.fmt.symmetric
        scales = int4_scales_and_zeros(layer.weight_scale, None if symmetric else layer.weight_min,
                                       self.fmt.group_size, group, layer.in_features,
                                       layer.int4_kernel_dtype)
        layer.register_buffer("int4_kernel_weight",
                              int4_kernel_pack(unpack_nibbles(layer.weight_packed)))
        layer.register_buffer("int4_kernel_scales", scales)
        layer.int4_kernel_group = group
        delattr(layer, "weight_packed")

    def weight_matmul(self, layer, x2):
        if hasattr(layer, "int4_kernel_weight"):
            y = int4_weight_only_mm(x2, layer.int4_kernel_weight, layer.int4_kernel_group,
                                    layer.int4_kernel_scales)
            if y is not None:
                return y
        return self.dequantized_matmul(layer, x2)

    def stored(self, layer, name):
        if name == "weight_packed" and hasattr(layer, "int4_kernel_weight"):
            return pack_nibbles(int4_kernel_unpack(layer.int4_kernel_weight, layer.in_features))
        return super().stored(layer, name)


def triton_gemv(layer: Linear, x2: torch.Tensor) -> torch.Tensor:
    """x2 [M, in] @ (weight * weight_scale)^T through kiln.kernels.triton.quant_gemv, in x2's
    dtype (fp32 sums, the scale applied once). Looked up per call: tests count calls."""
    from kiln.kernels.triton import quant_gemv

    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    return quant_gemv.weight_only_gemv(x2, layer.weight, layer.weight_scale)


_LOGGED: set[str] = set()


def _log_once(message: str) -> None:
    if message not in _LOGGED:
        _LOGGED.add(message)
        log.info(message)


def _find(storage: list[StoredTensor], name: str) -> StoredTensor | None:
    return next((t for t in storage if t.name == name), None)


def _check_shape(name: str, tensor: torch.Tensor, expected: torch.Size) -> None:
    if tuple(tensor.shape) != tuple(expected):
        raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)}, "
                         f"expected {tuple(expected)}")


def _check_dtype(name: str, got: torch.dtype, stored: torch.dtype) -> None:
    """Float scales convert freely; codes (ints, fp8) must already be in their stored dtype."""
    if got != stored and not (got in DENSE_DTYPES and stored in DENSE_DTYPES):
        raise ValueError(f"{name}: checkpoint dtype {got}, expected {stored}")


def method_class(fmt: WeightFormat) -> type[QuantLinearMethod]:
    if isinstance(fmt, Int4Format):
        return Int4LinearMethod
    return Int8LinearMethod if fmt.name == "int8" else QuantLinearMethod


def register_quant_methods() -> None:
    """Register one linear method per format name, plus its "-dyn" (activation-quant) twin."""
    for name in available_formats():
        fmt = get_format(name)
        cls = method_class(fmt)
        register_linear_method(name)(partial(cls, fmt))
        register_linear_method(name + DYNAMIC_SUFFIX)(partial(cls, fmt, act_quant=True))


register_quant_methods()
