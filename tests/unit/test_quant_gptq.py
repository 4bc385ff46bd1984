"""GPTQ rounding: the two-step format API it relies on, results on the format's own grid, and
lower output error than rounding to nearest."""

import pytest
import torch

from kiln.quant import get_format
from kiln.quant.gptq import Scales, _fixed_params, gptq_round

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
@pytest.mark.parametrize("scales", list(Scales))
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_weights_lie_on_the_grid_they_store(name, scales, act_order):
    fmt = get_format(name)
    x = correlated_inputs(512, 192)
    w = torch.randn(48, 192)
    rounded = gptq_round(w, x.t() @ x, fmt, shards=[32, 16], scales=scales, act_order=act_order)
    for rows in (slice(0, 32), slice(32, 48)):
        stored = rounded.stored(fmt, rows)
        assert set(stored) == {t.name for t in fmt.storage(16, 192)}
        assert torch.equal(fmt.dequantize(stored), rounded.weight[rows])


def output_error(x: torch.Tensor, w: torch.Tensor, rounded: torch.Tensor) -> float:
    return (x @ (rounded - w).t()).pow(2).mean().item()


@pytest.mark.parametrize("name", ["int4-g128-sym", "int4-g32-asym", "nvfp4", "mxfp4", "fp8"])
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_preserves_outputs_better_than_round_to_nearest(name, act_order):
    fmt = get_format(name)
    x = correlated_inputs(1024, 256, seed=1)
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(2))
    gptq = gptq_round(w, x.t() @ x, fmt, act_order=act_order).weight
    rtn = fmt.dequantize(fmt.quantize(w))
    assert output_error(x, w, gptq) < 0.9 * output_error(x, w, rtn)


@pytest.mark.parametrize("name", ["int4-g128-sym", "int4-g32-asym", "nvfp4", "mxfp4"])
def test_searched_scales_and_act_order_each_lower_the_output_error(name):
    """On weights with outliers and inputs of uneven scale (what real layers look like)."""
    fmt, g = get_format(name), torch.Generator().manual_seed(3)
    x = correlated_inputs(1024, 256, seed=4)
    w = torch.randn(64, 256, generator=g)
    w = torch.where(torch.rand(64, 256, generator=g) < 0.01, w * 8, w)
    h = x.t() @ x
    errors = [output_error(x, w, gptq_round(w, h, fmt, scales=s, act_order=a).weight)
              for s, a in ((Scales.ABSMAX, False), (Scales.MSE, False), (Scales.MSE, True))]
    assert errors[2] < errors[1] < errors[0]
