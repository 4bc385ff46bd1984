"""Compile every Triton kernel, at the configurations its entry function launches on a GPU,
down to a cubin for an NVIDIA architecture, on a machine without one (Triton's wheel carries
ptxas). The interpreter tests prove the kernels' arithmetic; this proves the GPU compiler takes
them, and prints each kernel's registers, spills and shared memory.

    TRITON_INTERPRET=0 python -m tests.kernels.triton.gpu_compile [--arch 90]

Each entry function runs on small CPU tensors with its kernels' launches recorded instead of
run (`Recorder`); each recorded launch is then compiled with the argument types it had.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass

import torch

TYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
              torch.int64: "i64", torch.int32: "i32", torch.int8: "i8", torch.uint8: "u8"}


@dataclass(frozen=True)
class Launch:
    kernel: object  # the JITFunction
    signature: dict[str, str]
    constexprs: dict[str, object]
    options: dict[str, int]  # num_warps / num_stages, where the entry function sets them


class Recorder:
    """Stands in for a JITFunction: `kernel[grid](*args, **constexprs)` records a Launch."""

    def __init__(self, kernel, launches: list[Launch]):
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        return self.record

    def record(self, *args, **constexprs):
        options = {k: constexprs.pop(k) for k in ("num_warps", "num_stages") if k in constexprs}
        names = self.kernel.arg_names
        signature = {name: "constexpr" for name in constexprs}
        for name, value in zip(names, args, strict=False):
            signature[name] = _type_of(value)
        self.launches.append(Launch(self.kernel, {n: signature[n] for n in names}, constexprs,
                                   options))


def _type_of(value) -> str:
    if isinstance(value, torch.Tensor):
        return "*" + TYPE_NAMES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -2**31 <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for {type(value)}")


def record_launches() -> list[Launch]:
    """Run each entry function on small CPU tensors (bf16 and fp32) with recorders in place."""
    from kiln.kernels.triton import (
        decode_attention,
        kv_cache,
        norm_rotary,
        prefill_attention,
        quant_gemv,
    )

    launches: list[Launch] = []
    modules = (decode_attention, kv_cache, norm_rotary, prefill_attention, quant_gemv)
    for module in modules:
        for name in [n for n in vars(module) if n.endswith("_kernel")]:
            setattr(module, name, Recorder(getattr(module, name), launches))
    for dtype, head_dim in ((torch.bfloat16, 128), (torch.bfloat16, 64), (torch.float32, 128)):
        _call_attention(dtype, head_dim)
    for dtype in (torch.bfloat16, torch.float32):
        _call_elementwise(dtype, head_dim=128)
    return launches


def _call_attention(dtype: torch.dtype, d: int) -> None:
    from kiln.kernels.triton.decode_attention import paged_decode_attention
    from kiln.kernels.triton.kv_cache import write_kv
    from kiln.kernels.triton.prefill_attention import paged_prefill_attention

    hq, hkv, block = 32, 8, 16
    cache = torch.zeros(64, hkv, d, dtype=dtype)
    q = torch.zeros(4, hq, d, dtype=dtype)
    table, lens = torch.zeros(4, 4, dtype=torch.int64), torch.ones(4, dtype=torch.int64)
    write_kv(q[:, :hkv], q[:, :hkv], cache, cache.clone(), lens)
    for splits in (1, 8):
        paged_decode_attention(q, cache, cache, table, lens, block, 0.1, num_splits=splits)
    for tree in (None, torch.zeros(4, dtype=torch.int64)):
        paged_prefill_attention(q, cache, cache, table, lens, lens, lens, block, 0.1,
                                max_query_len=1, tree_mask=tree)


def _call_elementwise(dtype: torch.dtype, head_dim: int) -> None:
    from kiln.kernels.triton.norm_rotary import fused_add_rms_norm, rms_norm, rotary_inplace
    from kiln.kernels.triton.quant_gemv import weight_only_gemv

    hq, hkv, d = 32, 8, head_dim
    lens = torch.ones(4, dtype=torch.int64)
    x = torch.zeros(4, 4096, dtype=dtype)
    rms_norm(x, x[0], 1e-6)
    fused_add_rms_norm(x, x.clone(), x[0], 1e-6)
    rotary_inplace(torch.zeros(4, (hq + 2 * hkv) * d, dtype=dtype), lens, torch.zeros(8, d),
                   torch.zeros(8, d), hq, hkv)
    for weight_dtype in (torch.int8, torch.float8_e4m3fn):
        weight_only_gemv(x, torch.zeros(64, 4096, dtype=weight_dtype), torch.ones(64, 1))


def compile_all(arch: int) -> list[str]:
    """Compile every recorded launch for sm_{arch}; one line of resource usage each."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    lines = []
    for launch in record_launches():
        if arch < 89 and launch.constexprs.get("FP8"):
            continue  # e4m3 needs sm_89 or newer
        source = ASTSource(launch.kernel, launch.signature, launch.constexprs)
        compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32),
                                  options=launch.options)
        lines.append(f"{launch.kernel.__name__} {_first_pointer(launch)} {launch.constexprs} "
                     f"{launch.options}: {_resource_usage(compiled.asm['cubin'])}, shared "
                     f"{compiled.metadata.shared} bytes")
    return lines


def _first_pointer(launch: Launch) -> str:
    return next(t for t in launch.signature.values() if t.startswith("*"))


def _resource_usage(cubin: bytes) -> str:
    """Registers and stack (spills), as cuobjdump (from Triton's wheel) reads them."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                        "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, "-res-usage", f.name], capture_output=True,
                              text=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", text)
    return "registers {}, stack {} bytes".format(*found.groups()) if found else "usage unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, default=90, help="sm_ version (80, 89, 90, ...)")
    arch = parser.parse_args().arch
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        sys.exit("run with TRITON_INTERPRET=0: the interpreter has no compiled kernels")
    for line in compile_all(arch):
        print(line)


if __name__ == "__main__":
    main()
