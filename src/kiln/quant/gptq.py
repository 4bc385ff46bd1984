"""GPTQ: calibrated rounding. Each layer's weights are rounded one input column at a time, and
each column's rounding error is pushed onto the columns not yet rounded, in the proportions
that best preserve the layer's outputs on calibration text (Frantar et al., 2022).

For a layer y = x W^T with calibration inputs X [T, in], H = X^T X. Rounding column j of W
moves the outputs by X[:, j] * err_j; spreading err_j / U[j, j] * U[j, j+1:] (U: the upper
Cholesky factor of H^-1) over the later columns cancels as much of it as a least-squares fit
can. By default the columns go in order of decreasing diag H ("act order": the most active
inputs first, while the most columns remain to absorb their error), and every group's grid
(format params) is fixed up front from the unrounded weight ("static groups"), so the stored
layout needs no per-column group index. In input order, a group fixes its grid when its first
column is reached, from the weights as updated so far. Either way the grid is searched
(`WeightFormat.fit`): the one with the least rounding error weighted by diag H, the inputs'
mean square, rather than the one spanning the group's min and max (`Scales.ABSMAX`).

Hessians come from the *reference* model's activations, so each layer's rounding is
independent of the formats chosen for the others, which layer selection needs (a plan may mix
formats freely). The result is a plain weight in the same format: serving is unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from enum import Enum

import torch
from torch import nn

from kiln.models.layers.linear import Linear, shard_rows
from kiln.quant.formats import Packed, WeightFormat, get_format
from kiln.runner.scoring import TeacherForcer

BLOCK_COLUMNS = 128  # columns updated lazily together (a multiple of every group size)
# Fraction of the mean diag H added to H. The GPTQ paper's 0.01 fits the calibration text too
# closely here (2 windows; held-out KL of nvfp4 0.090 at 0.01, 0.076 at 0.1, 0.077 at 0.3).
DAMP = 0.1


class Scales(Enum):
    """How each group's grid is chosen."""

    MSE = "mse"  # searched: least rounding error weighted by diag H (WeightFormat.fit)
    ABSMAX = "absmax"  # spanning the group's min and max (WeightFormat.params)


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
               shards: list[int] | None = None, damp: float = DAMP,
               scales: Scales = Scales.MSE, act_order: bool = True) -> Rounded:
    """Round W [out, in] into `fmt` with error feedback weighted by `hessian` [in, in].

    shards: row counts of a fused layer's parts (each gets its own per-tensor scale).
    damp: fraction of the mean diagonal added to H (keeps the Cholesky well conditioned, and
        the rounding from fitting the calibration inputs' quirks).
    scales: how each group's grid is chosen.
    act_order: round the inputs in order of decreasing diag H (the most active first, while
        the most columns remain to absorb their error). Groups then fix their grids up front,
        from the unrounded weight ("static groups"), so the stored layout is unchanged.
    """
    if not hessian.diagonal().any():  # no calibration token reached the layer (an expert
        hessian = torch.eye(len(hessian))  # none routed to): round to nearest, never zero it
    order = (torch.argsort(hessian.diagonal(), descending=True, stable=True) if act_order
             else torch.arange(len(hessian)))
    wt = weight.float().t()[order].contiguous()  # [in, out]: input order[k] is row k
    u = _inverse_cholesky(hessian[order][:, order], wt, damp)  # zeroes dead inputs' rows
    inverse = torch.argsort(order)
    width = len(wt) if fmt.per_channel else fmt.group_size
    fixed = _fixed_params(fmt, wt[inverse].t(), shards or [wt.shape[1]])
    importance = hessian.diagonal().float()  # [in]: each input's mean square (times tokens)

    def grid(w: torch.Tensor, start: int) -> Packed:  # w: [out, n], inputs start..start+n
        if scales is Scales.ABSMAX:
            return fmt.params(w, **fixed)
        return fmt.fit(w, importance[start:start + w.shape[1]], **fixed)

    static = fmt.per_channel or act_order
    grids = _split_groups(grid(wt[inverse].t(), 0)) if static else []  # one per group
    group_of = (order // width).tolist()  # the group of the k-th input rounded
    step = BLOCK_COLUMNS if fmt.per_channel else max(width, BLOCK_COLUMNS // width * width)
    for start in range(0, len(wt), step):
        end = min(start + step, len(wt))
        block, err = wt[start:end], torch.empty(end - start, wt.shape[1])  # views into wt
        for j in range(end - start):
            col = start + j
            if not static and col % width == 0:  # a group starts: fix its grid
                grids.append(grid(block[j:j + width].t(), col))
            q = fmt.snap(block[j][:, None], grids[group_of[col]])[:, 0]  # [out]
            err[j] = (block[j] - q) / u[col, col]
            block[j + 1:].addmm_(u[col, col + 1:end, None], err[j][None], alpha=-1.0)  # in block
            block[j] = q
        wt[end:].addmm_(u[start:end, end:].t(), err, alpha=-1.0)  # and to later columns
    return Rounded(wt[inverse].t().contiguous(), _join(grids))


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


def _split_groups(grid: Packed) -> list[Packed]:
    """A grid over all columns -> one grid per group (per-tensor parts shared)."""
    groups = max(v.shape[1] for v in grid.values() if v.dim() == 2)
    return [{k: v[:, i:i + 1] if v.dim() == 2 else v for k, v in grid.items()}
            for i in range(groups)]


def _join(grids: list[Packed]) -> Packed:
    """Per-group grids in column order -> one grid over all columns."""
    return {key: grids[0][key] if grids[0][key].dim() == 1
            else torch.cat([g[key] for g in grids], dim=1) for key in grids[0]}


class GptqQuantizer:
    """GPTQ-rounded weights of a reference model's layers, per format, made on first use.

    windows: calibration token windows (their inputs to each layer give its H).
    """

    def __init__(self, model: nn.Module, windows: torch.Tensor,
                 layers: Mapping[str, Linear], damp: float = DAMP,
                 scales: Scales = Scales.MSE, act_order: bool = True):
        self.layers = dict(layers)
        self.hessians = input_moments(model, windows, self.layers)
        self.damp = damp
        self.scales = scales
        self.act_order = act_order
        self._cache: dict[tuple[str, str], Rounded] = {}

    def rounded(self, name: str, fmt: str) -> Rounded:
        key = (name, fmt)
        if key not in self._cache:
            layer = self.layers[name]
            with single_thread():
                self._cache[key] = gptq_round(_dense(layer), self.hessians[name],
                                              get_format(fmt), layer.out_shards, self.damp,
                                              self.scales, self.act_order)
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
