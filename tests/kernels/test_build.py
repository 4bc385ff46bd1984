"""The loader of kiln/kernels/cpu: one library from every source there, the same ops as ever,
and a build that survives a killed one."""

from __future__ import annotations

import torch

from kiln.kernels import cpu as cpu_kernels
from tests.kernels.common import needs_cpu_kernels

pytestmark = needs_cpu_kernels

# every op the library registers (ops.cpp): adding or dropping one is a deliberate change here
OPS = {"rms_norm", "add_rms_norm", "silu_mul", "rotary_inplace", "qk_norm_rotary_inplace",
       "write_kv", "move_slots",
       "top_logprobs", "argmax_rows", "paged_attention", "prefill_attention", "has_bf16_attention",
       "int8_gemv", "bf16_gemm", "bf16_gemm_vectorized", "bf16_gemm_f32",
       "bf16_gemm_f32_dot_products", "bf16_vnni_mm", "bf16_vnni_available", "set_vnni_stream_ahead", "llama_stack",
       "shm_segment_bytes", "shm_segment_init", "shm_segment_join", "shm_all_reduce"}
OPS |= {"int8_vnni_mm", "int8_vnni_available", "int8_vnni_calls",
        "set_int8_wide_min_tokens"}  # gemm_int8_vnni.cpp
OPS |= {"moe_experts_vnni", "moe_experts_int8", "moe_experts_int8_vnni"}  # moe.cpp
OPS |= {"route_softmax"}  # router.cpp
OPS |= {"shm_all_to_all"}  # allreduce.cpp: the expert dispatch's all-to-all


def test_the_library_registers_every_op_once():
    names = [n.removeprefix("kiln::") for n in torch._C._dispatch_get_all_op_names()
             if n.startswith("kiln::")]
    assert sorted(names) == sorted(OPS)


def test_the_build_directory_follows_every_source_and_header():
    assert {p.suffix for p in cpu_kernels.SOURCES} == {".cpp"}
    assert {p.name for p in cpu_kernels.HEADERS} >= {"common.h", "ops.h"}
    assert cpu_kernels.build_directory().name.startswith("kiln_cpu_kernels_")


def test_a_build_lock_left_by_a_killed_build_does_not_hang_the_next_load():
    """torch's build lock is a plain file; a process killed mid-build leaves it, and torch
    would wait for it forever. kiln holds an flock around the build and clears it."""
    import subprocess
    import sys

    stale = cpu_kernels.build_directory() / "lock"
    stale.touch()
    done = subprocess.run([sys.executable, "-c", "from kiln.kernels import cpu; "
                           "raise SystemExit(0 if cpu.load() else 1)"], timeout=600)
    assert done.returncode == 0 and not stale.exists()
