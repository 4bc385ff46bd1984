"""kiln.kernels.quant_mm: which int8 kernel serves up to which token count, and the layout of
torch's CPU int4 kernel (packed and read back exactly, groups expressed exactly)."""

from __future__ import annotations

import pytest
import torch

from kiln.kernels import quant_mm
from kiln.kernels.quant_mm import (
    int4_kernel_group,
    int4_kernel_pack,
    int4_kernel_unavailable,
    int4_kernel_unpack,
)
from tests.kernels.common import needs_cpu_kernels

needs_kernel = pytest.mark.skipif(int4_kernel_unavailable(torch.bfloat16) is not None,
                                  reason="torch's CPU int4 kernel is not usable here")


@needs_cpu_kernels
def test_dispatch_serves_up_to_the_token_limit(monkeypatch):
    w = torch.randint(-127, 128, (16, 64), generator=torch.Generator().manual_seed(0),
                      dtype=torch.int8)
    scale = torch.logspace(-3, 0, 16).reshape(16, 1)
    limit = quant_mm.INT8_GEMV_MAX_TOKENS
    assert quant_mm.int8_gemv_mm(torch.randn(limit, 64), w, scale) is not None
    assert quant_mm.int8_gemv_mm(torch.randn(limit + 1, 64), w, scale) is None
    monkeypatch.setattr(quant_mm, "INT8_GEMV_MAX_TOKENS", 0)
    assert quant_mm.int8_gemv_mm(torch.randn(1, 64), w, scale) is None


@needs_kernel
@pytest.mark.parametrize("shape", [(80, 64), (960, 576), (576, 1536), (16, 32)])
def test_kernel_layout_unpacks_to_the_codes(shape):
    codes = torch.randint(0, 16, shape, dtype=torch.uint8)
    assert torch.equal(int4_kernel_unpack(int4_kernel_pack(codes), shape[1]), codes)


def test_kernel_group_expresses_kiln_groups_exactly():
    assert int4_kernel_group(128, 576, 960) == 64  # 576 = 4 x 128 + 64: 64 divides both
    assert int4_kernel_group(128, 1536, 576) == 128
    assert int4_kernel_group(32, 576, 960) == 32
    assert int4_kernel_group(128, 576, 100) is None  # the kernel wants out % 16 == 0
