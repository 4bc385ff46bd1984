"""GPTQ rounding: the two-step format API it relies on, results on the format's own grid, and
lower output error than rounding to nearest."""

import pytest
import torch

from kiln.quant import get_format
from kiln.quant.gptq import _fixed_params, gptq_round

NAMES = ["int8", "fp8", "int4-g32-asym", "int4-g64-sym", "int4-g128-sym", "nvfp4", "mxfp4"]


def correlated_inputs(tokens: int, features: int, seed: int = 0) -> torch.Tensor:
    """Inputs with correlated features and uneven scales, like a layer's activations."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(features, features, generator=g) / features ** 0.5
    scales = torch.exp(torch.randn(features, generator=g))
    return (torch.randn(tokens, features, generator=g) @ mix + torch.randn(
        tokens, features, generator=g)) * scales


@pytest.mark.parametrize("name", NAMES)
def test_snap_on_a_weights_own_grid_is_quantize_then_dequantize(name):
    fmt, w = get_format(name), torch.randn(24, 192)
    assert torch.equal(fmt.snap(w, fmt.params(w)), fmt.dequantize(fmt.quantize(w)))


@pytest.mark.parametrize("name", NAMES)
def test_a_single_column_snaps_onto_its_groups_grid(name):
    """GPTQ rounds one column at a time on a grid fixed for the whole group."""
    fmt, w = get_format(name), torch.randn(24, 64)
    width = 64 if fmt.per_channel else min(fmt.group_size, 64)
    full = fmt.snap(w, fmt.params(w))
    grid = fmt.params(w[:, :width], **_fixed_params(fmt, w, [24]))  # NVFP4: W's global scale
    for col in (0, width - 1):
        torch.testing.assert_close(fmt.snap(w[:, col:col + 1], grid)[:, 0], full[:, col],
                                   rtol=0, atol=0)


@pytest.mark.parametrize("name", NAMES)
def test_gptq_weights_lie_on_the_grid_they_store(name):
    fmt = get_format(name)
    x = correlated_inputs(512, 192)
    w = torch.randn(48, 192)
    rounded = gptq_round(w, x.t() @ x, fmt, shards=[32, 16])
    for rows in (slice(0, 32), slice(32, 48)):
        stored = rounded.stored(fmt, rows)
        assert set(stored) == {t.name for t in fmt.storage(16, 192)}
        assert torch.equal(fmt.dequantize(stored), rounded.weight[rows])


@pytest.mark.parametrize("name", ["int4-g128-sym", "int4-g32-asym", "nvfp4", "mxfp4", "fp8"])
def test_gptq_preserves_outputs_better_than_round_to_nearest(name):
    fmt = get_format(name)
    x = correlated_inputs(1024, 256, seed=1)
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(2))
    gptq = gptq_round(w, x.t() @ x, fmt).weight
    rtn = fmt.dequantize(fmt.quantize(w))
    err_gptq = (x @ (gptq - w).t()).pow(2).mean()
    err_rtn = (x @ (rtn - w).t()).pow(2).mean()
    assert err_gptq < 0.9 * err_rtn
