"""Every Triton kernel compiles for an H100 (sm_90) at the configurations its entry function
launches on a GPU, here without one (gpu_compile.py). Slow: ~20 compilations."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
KERNELS = ("_write_kv_kernel", "_decode_split_kernel", "_decode_reduce_kernel",
           "_prefill_kernel", "_rms_norm_kernel", "_rotary_kernel", "_gemv_kernel")


@pytest.mark.slow
def test_every_kernel_compiles_for_sm90():
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1",
               PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]))
    done = subprocess.run([sys.executable, "-m", "tests.kernels.triton.gpu_compile",
                           "--arch", "90"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    for kernel in KERNELS:
        assert any(line.startswith(kernel + " ") for line in lines), kernel
    # the tiles of the 16-bit launches were chosen so that nothing spills (attention_tiles)
    for line in lines:
        if " *bf16 " in line:
            assert "stack 0 bytes" in line, line
