"""kiln.kernels.triton.bench runs end to end (tiny sizes; the interpreter without a GPU) and
each kernel agrees with its torch baseline there."""

from __future__ import annotations

import pytest

from kiln.kernels.triton.bench import TINY, run_benchmarks
from tests.kernels.triton.common import DEVICES


@pytest.mark.parametrize("device", DEVICES)
def test_bench_runs_and_kernels_agree_with_baselines(device):
    rows = run_benchmarks(device, TINY)
    assert [r.kernel for r in rows] == ["copy", "decode_attention", "prefill_attention",
                                        "int8_gemv", "fused_add_rms_norm"]
    for row in rows:
        assert row.triton_us > 0 and row.baseline_us > 0 and row.bytes_moved > 0
        assert row.max_rel_err < 0.02, row  # bf16 inputs
