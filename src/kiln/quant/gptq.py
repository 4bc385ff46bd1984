"""GPTQ: calibrated rounding. Each layer's weights are rounded one input column at a time, and
each column's rounding error is pushed onto the columns not yet rounded, in the proportions
that best preserve the layer's outputs on calibration text (Frantar et al., 2022).

For a layer y = x W^T with calibration inputs X [T, in], H = X^T X. Rounding column j of W
moves the outputs by X[:, j] * err_j; spreading err_j / U[j, j] * U[j, j+1:] (U: the upper
Cholesky factor of H^-1) over the later columns cancels as much of it as a least-squares fit
can. Groups fix their grid (format params) when their first column is reached, from the
weights as updated so far; per-channel formats fix theirs up front.

Hessians come from the *reference* model's activations, so each layer's rounding is
independent of the formats chosen for the others, which layer selection needs (a plan may mix
formats freely). The result is a plain weight in the same format: serving is unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from kiln.models.layers.linear import Linear, shard_rows
from kiln.quant.formats import Packed, WeightFormat, get_format
from kiln.runner.scoring import TeacherForcer

BLOCK_COLUMNS = 128  # columns updated lazily together (a multiple of every group size)


@dataclass(frozen=True)
class Rounded:
    """A layer's weight in one format: the values it computes with and the format's grid."""

    weight: torch.Tensor  # float32 [out, in], on the grid
    params: Packed  # per-row/group grid tensors over all rows (global scale: one per row)

    def stored(self, fmt: WeightFormat, rows: slice) -> dict[str, torch.Tensor]:
        """The stored tensors of output rows `rows` (one shard of a fused layer)."""
        params = {k: (v[rows][:1] if v.dim() == 1 else v[rows]) for k, v in self.params.items()}
        return fmt.quantize(self.weight[rows], params)


@torch.inference_mode()
def input_moments(model: nn.Module, windows: torch.Tensor,
                  layers: Mapping[str, Linear]) -> dict[str, torch.Tensor]:
    """H = X^T X (float32 [in, in]) of each named layer's inputs over the windows' tokens."""
    hessians = {name: torch.zeros(m.in_features, m.in_features) for name, m in layers.items()}

    def hook(name):
        def accumulate(_module, args):
            x = args[0].reshape(-1, args[0].shape[-1]).float()
            hessians[name].addmm_(x.t(), x)
        return accumulate

    handles = [m.register_forward_pre_hook(hook(name)) for name, m in layers.items()]
    try:
        forcer = TeacherForcer(model, windows)
        for step in forcer.steps:
            forcer.forward(step)
    finally:
        for handle in handles:
            handle.remove()
    return hessians


def gptq_round(weight: torch.Tensor, hessian: torch.Tensor, fmt: WeightFormat,
               shards: list[int] | None = None, damp: float = 0.01) -> Rounded:
    """Round W [out, in] into `fmt` with error feedback weighted by `hessian` [in, in].

    shards: row counts of a fused layer's parts (each gets its own per-tensor scale).
    damp: fraction of the mean diagonal added to H (keeps the Cholesky well conditioned).
    """
    wt = weight.float().t().contiguous()  # [in, out]: column j of W is row j, contiguous
    u = _inverse_cholesky(hessian, wt, damp)  # zeroes the rows of dead inputs in wt
    width = len(wt) if fmt.per_channel else fmt.group_size
    fixed = _fixed_params(fmt, wt.t(), shards or [wt.shape[1]])
    grids = [fmt.params(wt.t(), **fixed)] if fmt.per_channel else []
    step = BLOCK_COLUMNS if fmt.per_channel else max(width, BLOCK_COLUMNS // width * width)
    for start in range(0, len(wt), step):
        end = min(start + step, len(wt))
        block, err = wt[start:end], torch.empty(end - start, wt.shape[1])  # views into wt
        for j in range(end - start):
            col = start + j
            if not fmt.per_channel and col % width == 0:  # a group starts: fix its grid
                grids.append(fmt.params(block[j:j + width].t(), **fixed))
            q = fmt.snap(block[j][:, None], grids[-1])[:, 0]  # [out], on its group's grid
            err[j] = (block[j] - q) / u[col, col]
            block[j + 1:].addmm_(u[col, col + 1:end, None], err[j][None], alpha=-1.0)  # in block
            block[j] = q
        wt[end:].addmm_(u[start:end, end:].t(), err, alpha=-1.0)  # and to later columns
    return Rounded(wt.t().contiguous(), _join(grids, fmt))


def _inverse_cholesky(hessian: torch.Tensor, wt: torch.Tensor, damp: float) -> torch.Tensor:
    """Upper Cholesky factor of (H + damp * mean(diag H) * I)^-1, in float64 for stability."""
    h = hessian.double().clone()
    dead = torch.diag(h) == 0  # inputs never active: their weights cannot matter
    h[dead, dead] = 1.0
    wt[dead] = 0.0
    h += damp * torch.diag(h).mean() * torch.eye(len(h), dtype=h.dtype)
    inverse = torch.cholesky_inverse(torch.linalg.cholesky(h))
    return torch.linalg.cholesky(inverse, upper=True).float()


def _fixed_params(fmt: WeightFormat, w: torch.Tensor, shards: list[int]) -> dict:
    """Per-tensor parts of the grid, fixed from the unrounded weight W [out, in] of each shard
    (NVFP4's global scale), as keyword arguments of `fmt.params`; {} when it has none."""
    if not hasattr(fmt, "global_scale"):
        return {}
    per_row = torch.cat([fmt.global_scale(w[shard_rows(shards, i)].abs().amax()).expand(n)
                         for i, n in enumerate(shards)])
    return {"global_scale": per_row}  # [out]


def _join(grids: list[Packed], fmt: WeightFormat) -> Packed:
    """Per-group grids in column order -> one grid over all columns."""
    if fmt.per_channel:
        return grids[0]
    out = {}
    for key in grids[0]:
        parts = [g[key] for g in grids]
        out[key] = parts[0] if parts[0].dim() == 1 else torch.cat(parts, dim=1)
    return out


class GptqQuantizer:
    """GPTQ-rounded weights of a reference model's layers, per format, made on first use.

    windows: calibration token windows (their inputs to each layer give its H).
    """

    def __init__(self, model: nn.Module, windows: torch.Tensor,
                 layers: Mapping[str, Linear], damp: float = 0.01):
        self.layers = dict(layers)
        self.hessians = input_moments(model, windows, self.layers)
        self.damp = damp
        self._cache: dict[tuple[str, str], Rounded] = {}

    def rounded(self, name: str, fmt: str) -> Rounded:
        key = (name, fmt)
        if key not in self._cache:
            layer = self.layers[name]
            with single_thread():
                self._cache[key] = gptq_round(_dense(layer), self.hessians[name],
                                              get_format(fmt), layer.out_shards, self.damp)
        return self._cache[key]

    def weight(self, name: str, fmt: str) -> torch.Tensor:
        return self.rounded(name, fmt).weight

    def checkpoint_quantizer(self, packed_modules: Mapping[str, tuple[str, int]],
                             ) -> Callable[[str, str, torch.Tensor], dict[str, torch.Tensor]]:
        """For kiln.quant.checkpoint.write_checkpoint: HF module -> its rows' stored tensors."""
        def quantize(module: str, fmt: str, _weight: torch.Tensor) -> dict[str, torch.Tensor]:
            base, _, leaf = module.rpartition(".")
            fused, shard = packed_modules.get(leaf, (leaf, 0))
            name = f"{base}.{fused}" if base else fused
            rows = shard_rows(self.layers[name].out_shards, shard)
            return self.rounded(name, fmt).stored(get_format(fmt), rows)
        return quantize


@contextmanager
def single_thread():
    """GPTQ is thousands of small sequential ops per layer; handing each to a second thread
    costs more than it saves (60x slower measured with 2 threads on a busy 2-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _dense(layer: Linear) -> torch.Tensor:
    from kiln.quant.evaluate import effective_weight

    return effective_weight(layer)
