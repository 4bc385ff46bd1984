"""Weight formats: exact round trips on representable values, error bounds, real storage sizes."""

import pytest
import torch

from kiln.quant import available_formats, get_format
from kiln.quant.packing import E2M1_GRID, e8m0_decode, fp8_e4m3_decode, to_fp8_e4m3

OUT, IN = 8, 128
INT4_NAMES = [f"int4-g{g}-{s}" for g in (32, 64, 128) for s in ("sym", "asym")]
ALL_NAMES = ["int8", "fp8", *INT4_NAMES, "nvfp4", "mxfp4"]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def pow2_rows(rows: int, g: torch.Generator) -> torch.Tensor:
    """[rows, 1] random powers of two, so scale arithmetic stays exact."""
    return torch.exp2(torch.randint(-8, 4, (rows, 1), generator=g).float())


def with_extreme(values: torch.Tensor, extreme: float, g: torch.Generator) -> torch.Tensor:
    """Set the first entry of every group (last dim) to +-extreme, fixing each group's max."""
    values = values.clone()
    sign = torch.randint(0, 2, values.shape[:-1], generator=g) * 2 - 1
    values[..., 0] = extreme * sign
    return values


def representable(name: str, g: torch.Generator) -> torch.Tensor:
    """A [OUT, IN] weight the format stores exactly (each group reaches its scale's extreme)."""
    fmt = get_format(name)
    if name == "int8":
        q = with_extreme(torch.randint(-127, 128, (OUT, IN), generator=g).float(), 127, g)
        return q * pow2_rows(OUT, g)
    if name == "fp8":
        q = to_fp8_e4m3(torch.randn(OUT, IN, generator=g) * 50).float()
        return with_extreme(q, 448, g) * pow2_rows(OUT, g)
    if name == "mxfp4":
        e = with_extreme(E2M1_GRID[torch.randint(0, 8, (OUT, IN // 32, 32), generator=g)], 6, g)
        return (e * torch.randint(-3, 3, e.shape[:2] + (1,), generator=g).exp2()).reshape(OUT, IN)
    if name == "nvfp4":
        e = with_extreme(E2M1_GRID[torch.randint(0, 8, (OUT, IN // 16, 16), generator=g)], 6, g)
        block = to_fp8_e4m3(torch.rand(OUT, IN // 16, 1, generator=g) * 400).float()
        block[0, 0] = 448  # the tensor max sets the global scale: 6 * 448 -> g = 1
        return (e * block).reshape(OUT, IN)
    shape = (OUT, IN // fmt.group_size, fmt.group_size)
    if fmt.symmetric:
        q = with_extreme(torch.randint(-7, 8, shape, generator=g).float(), 7, g)
    else:
        q = torch.randint(0, 16, shape, generator=g).float()
        q[..., 0], q[..., 1] = 0, 15  # the group's min and max
        q = q - torch.randint(0, 20, shape[:2] + (1,), generator=g)  # min = -j * scale
    return (q * pow2_rows(OUT, g).unsqueeze(2)).reshape(OUT, IN)


def round_trip(name: str, w: torch.Tensor) -> torch.Tensor:
    fmt = get_format(name)
    return fmt.dequantize(fmt.quantize(w))


@pytest.mark.parametrize("name", ALL_NAMES)
def test_representable_values_round_trip_exactly(name):
    w = representable(name, gen())
    assert torch.equal(round_trip(name, w), w)


@pytest.mark.parametrize("name", ALL_NAMES)
def test_quantize_matches_declared_storage(name):
    fmt = get_format(name)
    packed = fmt.quantize(torch.randn(OUT, IN, generator=gen()))
    specs = fmt.storage(OUT, IN)
    assert list(packed) == [t.name for t in specs]
    for t in specs:
        assert packed[t.name].dtype == t.dtype
        assert packed[t.name].shape == ((1,) if t.cols is None else (OUT, t.cols))


@pytest.mark.parametrize(("name", "bits"), [
    ("int8", 8 + 32 / IN), ("fp8", 8 + 32 / IN),
    ("int4-g32-asym", 4 + (16 + 16) / 32), ("int4-g64-asym", 4 + 32 / 64),
    ("int4-g128-asym", 4 + 32 / 128), ("int4-g32-sym", 4 + 16 / 32),
    ("int4-g128-sym", 4 + 16 / 128), ("int4", 4 + 16 / 128),
    ("nvfp4", 4 + 8 / 16 + 32 / (OUT * IN)), ("mxfp4", 4 + 8 / 32),
])
def test_bits_per_weight(name, bits):
    fmt = get_format(name)
    assert fmt.bits_per_weight(OUT, IN) == pytest.approx(bits, rel=1e-12)
    packed = fmt.quantize(torch.randn(OUT, IN, generator=gen()))
    stored_bits = sum(t.numel() * t.element_size() * 8 for t in packed.values())
    assert stored_bits / (OUT * IN) == pytest.approx(bits, rel=1e-12)  # the storage is real


@pytest.mark.parametrize(("name", "bits"), [
    ("int4-g128-sym", 4 + 16 * 5 / 576), ("int4-g32-asym", 4 + 32 * 18 / 576),
    ("nvfp4", 4 + 8 * 36 / 576 + 32 / (OUT * 576)), ("mxfp4", 4 + 8 * 18 / 576),
])
def test_bits_per_weight_with_a_short_last_group(name, bits):
    """576 = 4 * 128 + 64: g128 stores 5 scales per row."""
    fmt = get_format(name)
    assert fmt.bits_per_weight(OUT, 576) == pytest.approx(bits, rel=1e-12)
    packed = fmt.quantize(torch.randn(OUT, 576, generator=gen()))
    assert sum(t.numel() * t.element_size() * 8 for t in packed.values()) == bits * OUT * 576


def test_every_format_is_registered():
    assert set(ALL_NAMES) | {"int4"} == set(available_formats())


def per_element(per_group: torch.Tensor, group_size: int, in_features: int) -> torch.Tensor:
    """[out, groups] -> [out, in]: each group's value repeated over its (maybe short) group."""
    return per_group.repeat_interleave(group_size, dim=1)[:, :in_features]


def error_bound(name: str, w: torch.Tensor, packed: dict) -> torch.Tensor:
    """Largest error each element may have: half a grid step, plus scale rounding and clipping."""
    fmt, inp = get_format(name), w.shape[1]
    scale = packed["weight_scale"].float()
    if name == "int8":
        return scale / 2 * (1 + 1e-6)
    if name == "fp8":  # 3 mantissa bits: half an ulp is 2**-4 relative; subnormal step 2**-9
        return w.abs() * 2 ** -4 + scale * 2 ** -10
    if name == "mxfp4":  # half step <= 1 * scale; saturating at 6 < 8 * scale loses < 2 * scale
        return per_element(e8m0_decode(packed["weight_scale"]) * 2, 32, inp)
    if name == "nvfp4":  # half step <= 1 * eff; fp8 rounding of a (normal) block scale clips
        # < 0.4 * eff. A block scale that underflows fp8 (block max < max|W| / 28672) would not.
        eff = fp8_e4m3_decode(packed["weight_scale"]) / packed["weight_global_scale"]
        return per_element(eff, 16, inp) * (1 + 1e-6)
    step = per_element(scale, fmt.group_size, inp)
    if fmt.symmetric:
        return step * (0.5 + 2 ** -10)
    minimum = per_element(packed["weight_min"].float().abs(), fmt.group_size, inp)
    return step * (0.5 + 16 * 2 ** -11) + minimum * 2 ** -11  # fp16 rounding of scale and min


@pytest.mark.parametrize("name", ALL_NAMES)
@pytest.mark.parametrize("spread", [1e-3, 1.0, 30.0])
@pytest.mark.parametrize("in_features", [IN, 584])  # 584: a short last group in every format
def test_error_is_within_the_formats_bound(name, spread, in_features):
    g = gen(1)
    w = torch.randn(OUT, in_features, generator=g) * spread * torch.rand(OUT, 1, generator=g).exp2()
    packed = get_format(name).quantize(w)
    err = (get_format(name).dequantize(packed) - w).abs()
    assert (err <= error_bound(name, w, packed)).all()


@pytest.mark.parametrize(("name", "max_rel_rmse"), [
    ("int8", 0.01), ("fp8", 0.03), ("int4-g32-asym", 0.09), ("int4-g128-sym", 0.13),
    ("nvfp4", 0.11), ("mxfp4", 0.13),
])
def test_relative_error_on_gaussian_weights(name, max_rel_rmse):
    w = torch.randn(64, 256, generator=gen(2))
    assert (round_trip(name, w) - w).norm() / w.norm() < max_rel_rmse


@pytest.mark.parametrize("name", ALL_NAMES)
def test_zero_weights_stay_zero(name):
    w = torch.zeros(OUT, IN)
    assert torch.equal(round_trip(name, w), w)


@pytest.mark.parametrize("name", ALL_NAMES)
def test_fake_quantize_is_per_row(name):
    """Activation quantization of one token must not depend on the other tokens of the batch."""
    fmt = get_format(name)
    x = torch.randn(4, IN, generator=gen(3))
    x[2] *= 1000
    assert torch.equal(fmt.fake_quantize(x)[:1], fmt.fake_quantize(x[:1]))


# -- searched grids (WeightFormat.fit) --------------------------------------------------------

SEARCHED = [*INT4_NAMES, "nvfp4", "mxfp4"]


def heavy_tailed(rows: int, cols: int, g: torch.Generator) -> torch.Tensor:
    """Gaussian weights with a few large outliers, the case absmax scales handle worst."""
    w = torch.randn(rows, cols, generator=g)
    outliers = torch.rand(rows, cols, generator=g) < 0.01
    return torch.where(outliers, w * 8, w)


@pytest.mark.parametrize("name", SEARCHED)
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("in_features", [IN, 584])
def test_fit_never_has_a_larger_group_error_than_absmax(name, weighted, in_features):
    fmt, g = get_format(name), gen(4)
    w = heavy_tailed(32, in_features, g)
    importance = torch.rand(in_features, generator=g).pow(4) if weighted else None
    fitted = fmt.group_error(w, fmt.fit(w, importance), importance)
    absmax = fmt.group_error(w, fmt.params(w), importance)
    assert fitted.shape == absmax.shape == (32, fmt.groups(in_features))
    assert (fitted <= absmax).all()
    assert fitted.sum() < 0.95 * absmax.sum()


@pytest.mark.parametrize("name", SEARCHED)
def test_fitted_grids_are_stored_exactly(name):
    """A searched grid is still the format's: its tensors have the declared dtypes and
    shapes, and the stored weight reads back as the values rounded onto it."""
    fmt = get_format(name)
    w = heavy_tailed(OUT, IN, gen(5))
    grid = fmt.fit(w)
    packed = fmt.quantize(w, grid)
    for t in fmt.storage(OUT, IN):
        assert packed[t.name].dtype == t.dtype
        assert packed[t.name].shape == ((1,) if t.cols is None else (OUT, t.cols))
    assert torch.equal(fmt.dequantize(packed), fmt.snap(w, grid))


def test_nvfp4_fit_keeps_the_global_scale_and_shrinks_block_scales():
    fmt = get_format("nvfp4")
    w = heavy_tailed(OUT, IN, gen(6))
    fitted, absmax = fmt.fit(w), fmt.params(w)
    assert torch.equal(fitted["weight_global_scale"], absmax["weight_global_scale"])
    scale, absmax_scale = (fp8_e4m3_decode(p["weight_scale"]) for p in (fitted, absmax))
    assert (scale <= absmax_scale).all() and (scale < absmax_scale).any()


def test_mxfp4_fit_moves_exponents_by_at_most_one():
    fmt = get_format("mxfp4")
    w = heavy_tailed(OUT, IN, gen(7))
    fitted, absmax = (p["weight_scale"].int() for p in (fmt.fit(w), fmt.params(w)))
    assert (fitted - absmax).abs().max() <= 1 and (fitted != absmax).any()


@pytest.mark.parametrize("name", ["int8", "fp8"])
def test_formats_without_shrinks_fit_their_absmax_grid(name):
    fmt, w = get_format(name), heavy_tailed(OUT, IN, gen(8))
    assert torch.equal(fmt.fit(w)["weight_scale"], fmt.params(w)["weight_scale"])
