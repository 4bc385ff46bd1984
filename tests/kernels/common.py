"""What the kernel tests share: whether the C++ kernels built, the dtypes they run and how close
to the torch reference each must come."""

from __future__ import annotations

import pytest
import torch

from kiln.kernels import cpu as cpu_kernels

needs_cpu_kernels = pytest.mark.skipif(not cpu_kernels.load(),
                                       reason="kiln CPU kernels did not build")

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
DTYPES = [torch.float32, torch.bfloat16]


def close(a, b, dtype):
    torch.testing.assert_close(a.float(), b.float(), atol=TOL[dtype], rtol=TOL[dtype])
