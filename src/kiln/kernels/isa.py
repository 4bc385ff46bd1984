"""What this CPU can do, read once: its model and the instruction sets kiln's kernels choose by.

The C++ kernels are compiled with -march=native, so the compiler already picks instructions
for the machine they build on; what is decided at run time in Python (which matmul serves an
LM head, how many tokens a GEMV kernel takes before a GEMM wins) asks `cpu_isa()` and
`kernel_tuning()` here. The ISA is logged once at start (kiln.platform), shown in
`/metrics` (`kiln:cpu_info`) and by `kiln models list`.

`kernel_tuning()` is where a per-CPU choice goes: TUNINGS maps a CPU (vendor, family, model)
or, failing that, its best ISA level to the kernel parameters measured best there. Today every
CPU gets the defaults (a later issue measures and fills the table).
"""

from __future__ import annotations

import functools
import platform
from dataclasses import dataclass

# /proc/cpuinfo flag -> the name kiln reports, best first
EXTENSIONS = (
    ("amx_bf16", "amx-bf16"),
    ("amx_int8", "amx-int8"),
    ("avx512_bf16", "avx512-bf16"),
    ("avx512_vnni", "avx512-vnni"),
    ("avx512f", "avx512f"),
    ("avx2", "avx2"),
)


@dataclass(frozen=True)
class CpuIsa:
    """The CPU's identity and the instruction sets that decide kiln's kernels."""

    model_name: str  # "AMD EPYC 9R14", "Intel(R) Xeon(R) Platinum 8488C", ...
    vendor: str  # "AuthenticAMD", "GenuineIntel", or the machine type elsewhere
    family: int | None
    model: int | None
    extensions: tuple[str, ...]  # names from EXTENSIONS, best first

    @property
    def level(self) -> str:
        """The best matmul level: amx, avx512-bf16, avx512, avx2 or generic."""
        has = set(self.extensions)
        if "amx-bf16" in has:
            return "amx"
        if "avx512-bf16" in has:
            return "avx512-bf16"
        if "avx512f" in has:
            return "avx512"
        return "avx2" if "avx2" in has else "generic"

    def describe(self) -> str:
        ids = "" if self.family is None else f" (family {self.family}, model {self.model})"
        return f"{self.model_name}{ids}: {' '.join(self.extensions) or 'no vector extensions'}"


def parse_cpuinfo(text: str) -> CpuIsa:
    """The first processor's entry of a /proc/cpuinfo text."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    flags = set((fields.get("flags") or fields.get("Features") or "").split())
    return CpuIsa(
        model_name=fields.get("model name") or platform.processor() or platform.machine(),
        vendor=fields.get("vendor_id") or platform.machine(),
        family=_int(fields.get("cpu family")), model=_int(fields.get("model")),
        extensions=tuple(name for flag, name in EXTENSIONS if flag in flags))


def _int(value: str | None) -> int | None:
    return int(value) if value and value.isdigit() else None


@functools.cache
def cpu_isa(cpuinfo: str = "/proc/cpuinfo") -> CpuIsa:
    """This machine's CPU, read once per process."""
    try:
        with open(cpuinfo) as f:
            return parse_cpuinfo(f.read())
    except OSError:
        return parse_cpuinfo("")


@dataclass(frozen=True)
class KernelTuning:
    """Kernel parameters a CPU may want chosen for it (defaults: measured on a Zen 4 EPYC)."""

    bf16_gemm_max_tokens: int = 32  # kiln's bf16_gemm up to here, widened fp32 GEMM beyond
    int8_gemv_max_tokens: int = 8  # kiln's int8_gemv up to here, torch's int8 kernel beyond


DEFAULT_TUNING = KernelTuning()

# (vendor, family, model) or an ISA level -> its tuning; empty until measured per CPU
TUNINGS: dict[tuple[str, int | None, int | None] | str, KernelTuning] = {}


def kernel_tuning(isa: CpuIsa | None = None) -> KernelTuning:
    """The tuning for `isa` (this CPU by default): its exact model's, else its level's."""
    isa = isa or cpu_isa()
    return (TUNINGS.get((isa.vendor, isa.family, isa.model)) or TUNINGS.get(isa.level)
            or DEFAULT_TUNING)
