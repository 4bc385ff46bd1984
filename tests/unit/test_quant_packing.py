"""Bit-level helpers of kiln.quant: nibble packing, E2M1 and E8M0 codes."""

import pytest
import torch

from kiln.quant.packing import (
    E2M1_GRID,
    e2m1_decode,
    e2m1_encode,
    e8m0_decode,
    e8m0_encode_floor,
    fp8_e4m3_decode,
    pack_nibbles,
    to_fp8_e4m3,
    unpack_nibbles,
)


def test_pack_then_unpack_is_identity():
    codes = torch.randint(0, 16, (7, 64), dtype=torch.uint8)
    packed = pack_nibbles(codes)
    assert packed.shape == (7, 32) and packed.dtype == torch.uint8
    assert torch.equal(unpack_nibbles(packed), codes)


def test_unpack_then_pack_is_identity_on_every_byte():
    every_byte = torch.arange(256, dtype=torch.uint8)
    assert torch.equal(pack_nibbles(unpack_nibbles(every_byte)), every_byte)


def test_even_index_goes_to_the_low_nibble():
    assert pack_nibbles(torch.tensor([1, 2, 15, 0], dtype=torch.uint8)).tolist() == [0x21, 0x0F]


def test_odd_count_is_rejected():
    with pytest.raises(ValueError):
        pack_nibbles(torch.zeros(3, dtype=torch.uint8))


def test_e2m1_codes_round_trip():
    codes = torch.arange(16, dtype=torch.uint8)
    values = e2m1_decode(codes)
    assert values[:8].tolist() == E2M1_GRID.tolist()
    assert torch.equal(values[8:], -values[:8])
    assert torch.equal(e2m1_decode(e2m1_encode(values)), values)  # -0 decodes equal to +0


@pytest.mark.parametrize(("x", "expected"), [
    (0.25, 0.0), (0.75, 1.0), (1.25, 1.0), (1.75, 2.0), (2.5, 2.0), (3.5, 4.0), (5.0, 4.0),
    (0.26, 0.5), (4.9, 4.0), (5.1, 6.0), (7.0, 6.0), (1e9, 6.0), (-3.5, -4.0), (-100.0, -6.0),
])
def test_e2m1_rounds_to_nearest_even_and_saturates(x, expected):
    assert e2m1_decode(e2m1_encode(torch.tensor([x]))).item() == expected


def test_e8m0_decodes_powers_of_two():
    e = torch.tensor([0, 1, 125, 127, 128, 254], dtype=torch.uint8)
    assert e8m0_decode(e).tolist() == [2.0 ** -127, 2.0 ** -126, 0.25, 1.0, 2.0, 2.0 ** 127]


def test_e8m0_shared_exponent_is_floor_log2_minus_emax():
    amax = torch.tensor([6.0, 4.0, 7.99, 1.0, 0.0, 3e38, 1e-45])
    exponents = e8m0_encode_floor(amax, elem_emax=2).int() - 127
    assert exponents.tolist() == [0, 0, 0, -2, -127, 125, -127]  # zero and tiny clamp to -127


def test_fp8_cast_saturates_instead_of_nan():
    assert to_fp8_e4m3(torch.tensor([1e6, -1e6])).float().tolist() == [448.0, -448.0]


def test_fp8_decode_matches_torch_cast_on_every_code():
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    expected = codes.float()
    finite = ~expected.isnan()
    assert torch.equal(fp8_e4m3_decode(codes)[finite], expected[finite])
