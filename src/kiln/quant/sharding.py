"""How a weight format's stored tensors split across tensor-parallel ranks.

Every format quantizes along the input dimension (kiln.quant.formats), so:
  - by output rows (column-parallel: QKV, gate/up) every per-row tensor — codes, per-row or
    per-group scales, group minimums — splits with its rows; a per-tensor scalar (NVFP4's
    global scale, or a per-tensor fp8 scale standing for every row) is kept whole;
  - by input columns (row-parallel: o_proj, down_proj) the codes split by columns (two per
    byte when packed), a per-row scale is kept whole, and per-group tensors split by groups:
    a rank's columns must be whole groups, or its scales would be other numbers than one
    process's. A per-tensor scalar is kept whole.
A dense checkpoint weight is quantized over the whole tensor first and then split, so every
rank holds exactly the codes and scales one process would (NVFP4's global scale comes from
max|W| over all rows and columns).

Activations quantized per token ("-dyn") are computed on the input a rank sees: whole rows
in a column-parallel layer (the same numbers), only its columns in a row-parallel one. There
a per-group scheme (int4, MXFP4 blocks) is unchanged when the columns are whole groups, but a
per-token scale over the whole row (int8, fp8, NVFP4's global scale) is not.
"""

from __future__ import annotations

import torch

from kiln.quant.formats import Packed, WeightFormat


def is_scalar(fmt: WeightFormat, name: str, tensor: torch.Tensor) -> bool:
    """A per-tensor scalar: kept whole on every rank."""
    spec = next((t for t in fmt.storage(2, 2 * fmt.group_size) if t.name == name), None)
    return spec is not None and (spec.cols is None or (spec.cols == 1 and tensor.numel() == 1))


def rows_of(fmt: WeightFormat, name: str, tensor: torch.Tensor, rows: slice,
            size: int) -> torch.Tensor:
    """Stored tensor `name`'s output rows `rows`, zero-padded to `size` rows; a scalar whole."""
    if is_scalar(fmt, name, tensor):
        return tensor
    part = tensor[rows]
    if part.shape[0] == size:
        return part
    return torch.cat([part, part.new_zeros((size - part.shape[0], *part.shape[1:]))])


def columns_of(fmt: WeightFormat, name: str, tensor: torch.Tensor, cols: slice) -> torch.Tensor:
    """Stored tensor `name`'s part for input columns `cols` (whole groups: check_columns)."""
    if is_scalar(fmt, name, tensor) or (fmt.per_channel and name != fmt.code_name):
        return tensor  # a per-tensor scalar, or a per-row scale: the whole row's
    if tensor.dim() != 2:
        raise ValueError(f"row-parallel {fmt.name} linear: cannot split checkpoint tensor "
                         f"{name!r} {tuple(tensor.shape)} by input columns")
    if name == fmt.code_name:
        per = 2 if fmt.packs_nibbles else 1  # codes per stored element
        return tensor[:, cols.start // per:cols.stop // per]
    first = cols.start // fmt.group_size  # per-group tensors: this rank's groups
    return tensor[:, first:first + fmt.groups(cols.stop - cols.start)]


def check_columns(fmt: WeightFormat, act_quant: bool, world: int,
                  in_features: int | None = None) -> None:
    """ValueError where a layer of `in_features` inputs in `fmt` cannot be split into `world`
    equal column ranges (None: only what holds for any size)."""
    name = fmt.name + ("-dyn" if act_quant else "")
    whole_row = fmt.per_channel or any(t.cols is None for t in fmt.storage(2, 2 * fmt.group_size))
    if act_quant and whole_row:
        raise ValueError(f"weight format {name!r} cannot be split across tensor-parallel ranks: "
                         f"it quantizes activations per token over the whole row, which a "
                         f"row-parallel rank does not see (use {fmt.name!r}, weight-only)")
    if in_features is None or fmt.per_channel:
        return
    per_rank = in_features // world
    if per_rank % fmt.group_size or (fmt.packs_nibbles and per_rank % 2):
        raise ValueError(f"weight format {name!r} has groups of {fmt.group_size} inputs: "
                         f"tensor_parallel_size {world} splits a layer's {in_features} inputs "
                         f"into {per_rank} per rank, which cuts a group (choose a size whose "
                         f"share of every row-parallel layer's inputs is whole groups)")


def quantized_whole(fmt: WeightFormat, name: str, tensor: torch.Tensor,
                    dense: tuple[torch.dtype, ...]) -> Packed:
    """A checkpoint tensor as the stored tensors one process holds: a dense "weight" quantized
    over the whole tensor, any other tensor as it is."""
    if name == "weight" and tensor.dtype in dense:
        return fmt.quantize(tensor)
    return {name: tensor}
