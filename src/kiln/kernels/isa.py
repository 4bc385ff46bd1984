"""What this CPU can do, read once: its model and the instruction sets kiln's kernels choose by.

The C++ kernels are compiled with -march=native, so the compiler already picks instructions
for the machine they build on; what is decided at run time in Python (which matmul serves an
LM head, how many tokens a GEMV kernel takes before a GEMM wins) asks `cpu_isa()` and
`kernel_tuning()` here. The ISA is logged once at start (kiln.platform), shown in
`/metrics` (`kiln:cpu_info`) and by `kiln models list`.

`kernel_tuning()` is where a per-CPU choice goes: TUNINGS maps a CPU (vendor, family, model),
failing that its family (vendor, family, None), failing that its best ISA level to the kernel
parameters measured best there. AMD's Zen 5 family streams the one-token GEMV's weights with
a non-temporal prefetch (decision 0024); every other CPU gets the defaults until measured.
`vnni_stream_ahead()` applies the choice to the C++ kernels when they load.

`gemm_dispatch()` is the rule between kiln's AVX-512 kernels and oneDNN's GEMM (through torch)
by the number of rows M: on CPUs with AMX, oneDNN serves from `amx_min_tokens` rows on (its
kernels there are AMX tile ones), kiln's kernels below; elsewhere each caller keeps its own
limits. It is logged once, the first time a GEMM asks. docs/decisions/0011 says why.
`onednn_implementations(fn)` names the oneDNN kernels `fn` runs (what ONEDNN_VERBOSE prints):
the tests and benchmarks/ceiling.py use it to check that AMX is really what runs.
"""

from __future__ import annotations

import enum
import functools
import logging
import os
import platform
import tempfile
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

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
    # on AMX CPUs: oneDNN's GEMM (AMX tiles) from this many rows on, kiln's/torch's AVX-512
    # kernels below. Not yet measured on an AMX machine: 16 fills one AMX tile's 16 rows, so a
    # smaller M wastes most of each tile multiply (SGLang's CPU kernels switch at M > 4).
    amx_min_tokens: int = 16
    # one-token bf16 GEMV on VNNI-packed weights: each line is prefetched this many bytes ahead
    # with the non-temporal hint, 0 = off (measured on Zen 5 only: decision 0024)
    vnni_stream_ahead: int = 0
    # weight-only int8 on VNNI-packed codes with bf16 activations: from this many tokens on
    # the codes are widened to bf16 a panel at a time and multiplied with bf16 dot products
    # (2 per 64 weights and token against the digit kernel's 3), 0 = never. Zen 5, the
    # default model's four layer shapes, against the digits: 1.2x the time at 8 tokens, 0.73x
    # at 16, 0.64x at 32, 0.54x at 512 (decision 0025)
    int8_wide_min_tokens: int = 16


DEFAULT_TUNING = KernelTuning()

# (vendor, family, model), (vendor, family, None) for a whole family, or an ISA level -> its
# tuning, where measured
TUNINGS: dict[tuple[str, int | None, int | None] | str, KernelTuning] = {
    # Zen 5 (EPYC 9005): batch-1 decode of the default model 159.3 -> 173.0 tok/s (0024)
    ("AuthenticAMD", 26, None): KernelTuning(vnni_stream_ahead=4096),
}


def kernel_tuning(isa: CpuIsa | None = None) -> KernelTuning:
    """The tuning for `isa` (this CPU by default): its exact model's, else its family's, else
    its level's."""
    isa = isa or cpu_isa()
    return (TUNINGS.get((isa.vendor, isa.family, isa.model))
            or TUNINGS.get((isa.vendor, isa.family, None)) or TUNINGS.get(isa.level)
            or DEFAULT_TUNING)


MAX_STREAM_AHEAD = 1 << 20  # bytes; the C++ setter checks the same bound


def count_override(name: str, override: str, what: str, least: int = 0,
                   most: int | None = None) -> int:
    """A kernel environment variable's whole-number value, or a ValueError naming it: "`name`
    must be `what`, not '...'"."""
    value = override.strip()
    if not value.isdigit() or int(value) < least or (most is not None and int(value) > most):
        raise ValueError(f"{name} must be {what}, not {override!r}")
    return int(value)


def stream_ahead_for(tuning: KernelTuning, override: str | None = None) -> int:
    """The one-token GEMV's prefetch distance in bytes: the tuning's, or `override` (the
    KILN_VNNI_STREAM_AHEAD environment variable: bytes, 0 = off)."""
    if override is None:
        return tuning.vnni_stream_ahead
    return count_override("KILN_VNNI_STREAM_AHEAD", override,
                          f"a byte count from 0 (off) to {MAX_STREAM_AHEAD}",
                          most=MAX_STREAM_AHEAD)


def stream_ahead() -> int:
    """This machine's distance: its tuning's, or KILN_VNNI_STREAM_AHEAD's (a bad value raises)."""
    return stream_ahead_for(kernel_tuning(), os.environ.get("KILN_VNNI_STREAM_AHEAD"))


def int8_wide_min_tokens_for(tuning: KernelTuning, override: str | None = None) -> int:
    """From how many bf16 tokens the int8 kernel widens its codes: the tuning's, or
    `override` (the KILN_INT8_WIDE_MIN_TOKENS environment variable: tokens, 0 = never)."""
    if override is None:
        return tuning.int8_wide_min_tokens
    return count_override("KILN_INT8_WIDE_MIN_TOKENS", override, "a token count, 0 for never")


def int8_wide_min_tokens() -> int:
    """This machine's: its tuning's, or KILN_INT8_WIDE_MIN_TOKENS's (a bad value raises)."""
    return int8_wide_min_tokens_for(kernel_tuning(), os.environ.get("KILN_INT8_WIDE_MIN_TOKENS"))


def check_environment() -> None:
    """Raise a ValueError naming a kernel environment variable whose value this machine cannot
    use (KILN_AMX_MIN_TOKENS on AMX CPUs, KILN_VNNI_STREAM_AHEAD, KILN_INT8_WIDE_MIN_TOKENS):
    the CLI asks before it starts anything, so a worker process does not fail on it later."""
    dispatch_for(cpu_isa(), kernel_tuning(), os.environ.get("KILN_AMX_MIN_TOKENS"))
    stream_ahead()
    int8_wide_min_tokens()


def vnni_stream_ahead(bytes_ahead: int | None = None) -> int:
    """Set `bytes_ahead` (default: this machine's, `stream_ahead()`) in the loaded C++ kernels
    and return it (logged)."""
    import torch

    bytes_ahead = stream_ahead() if bytes_ahead is None else bytes_ahead
    torch.ops.kiln.set_vnni_stream_ahead(bytes_ahead)
    log.info("one-token GEMV stream (%s): %s", cpu_isa().level,
             f"non-temporal prefetch {bytes_ahead} bytes ahead" if bytes_ahead else "off")
    return bytes_ahead


class GemmPath(enum.Enum):
    """Which kernel family serves a GEMM of a given row count."""

    KILN = "kiln"  # kiln's (or torch's own vectorized) AVX-512/AVX2 kernels: GEMV-sized M
    ONEDNN = "onednn"  # oneDNN's GEMM through torch: AMX tile kernels where the CPU has them


@dataclass(frozen=True)
class GemmDispatch:
    """The M rule: oneDNN from `onednn_min_tokens` rows on; None where the CPU has no AMX
    (each caller then keeps its own limits, measured on AVX-512 and AVX2 CPUs)."""

    onednn_min_tokens: int | None

    def path(self, tokens: int) -> GemmPath:
        if self.onednn_min_tokens is not None and tokens >= self.onednn_min_tokens:
            return GemmPath.ONEDNN
        return GemmPath.KILN

    def describe(self) -> str:
        if self.onednn_min_tokens is None:
            return "no AMX: kiln's AVX-512/AVX2 GEMM limits"
        return (f"oneDNN AMX GEMM from {self.onednn_min_tokens} rows, kiln's AVX-512 kernels "
                f"below")


def dispatch_for(isa: CpuIsa, tuning: KernelTuning, override: str | None = None) -> GemmDispatch:
    """The rule for `isa`: AMX-BF16 CPUs switch at the tuned row count; `override` (the
    KILN_AMX_MIN_TOKENS environment variable: a row count, or "off") replaces it."""
    if override is not None and override.strip().lower() == "off":
        return GemmDispatch(None)
    if "amx-bf16" not in isa.extensions:
        return GemmDispatch(None)
    if override is None:
        return GemmDispatch(tuning.amx_min_tokens)
    return GemmDispatch(count_override("KILN_AMX_MIN_TOKENS", override,
                                       "a row count >= 1 or 'off'", least=1))


@functools.cache
def gemm_dispatch() -> GemmDispatch:
    """This machine's rule, decided and logged once per process."""
    rule = dispatch_for(cpu_isa(), kernel_tuning(), os.environ.get("KILN_AMX_MIN_TOKENS"))
    log.info("GEMM dispatch (%s): %s", cpu_isa().level, rule.describe())
    return rule


def onednn_implementations(fn: Callable[[], object]) -> list[str]:
    """The oneDNN primitives `fn()` runs, one "kind:implementation" per execution (e.g.
    "inner_product:brg_matmul:avx512_core_amx", "reorder:jit:uni"; "gemm_api:" for oneDNN's
    BLAS-like gemm, whose verbose line names no kernel), read from oneDNN's verbose output.

    oneDNN prints to the process's stdout (file descriptor 1), so it is redirected to a file
    for the call. Primitives created before the call and cached by torch still print their
    executions; nothing runs twice.
    """
    import torch

    with tempfile.TemporaryFile(mode="w+b") as sink:
        saved = os.dup(1)
        try:
            os.dup2(sink.fileno(), 1)
            with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
                fn()
        finally:
            os.dup2(saved, 1)
            os.close(saved)
        sink.seek(0)
        lines = sink.read().decode(errors="replace").splitlines()
    return [_implementation(line) for line in lines if ",exec,cpu," in line]


def _implementation(line: str) -> str:
    # onednn_verbose,v1,primitive,exec,cpu,<kind>,<implementation>,<prop>,...
    fields = line.split(",")
    at = fields.index("cpu")
    return f"{fields[at + 1]}:{fields[at + 2]}"
