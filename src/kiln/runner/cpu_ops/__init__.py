"""kiln's C++ CPU kernels, compiled on first use with torch's extension tooling.

`load()` builds kernels.cpp (once per machine and version of the source; cached under
$TORCH_EXTENSIONS_DIR, by default ~/.cache/torch_extensions) and registers the ops as
`torch.ops.kiln.*`. If the build fails (no compiler, no ninja) it logs one line and returns
False: callers then use the plain torch reference path, which every kernel is tested against.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)
_lock = threading.Lock()
_state: dict[str, bool] = {}


def _build() -> None:
    from torch.utils.cpp_extension import load

    source = Path(__file__).with_name("kernels.cpp")
    flags = ["-O3", "-fopenmp", "-march=native", "-ffast-math", "-fno-finite-math-only"]
    # named by the source's hash: two kiln checkouts on one machine (a CI clone beside a work
    # tree) would otherwise rebuild one build directory in turn and load each other's library
    digest = hashlib.sha256(source.read_bytes() + " ".join(flags).encode()).hexdigest()[:12]
    load(name=f"kiln_cpu_ops_{digest}", sources=[str(source)], extra_cflags=flags,
         extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)


def load() -> bool:
    """Build and register the kernels once; True if `torch.ops.kiln` is usable."""
    with _lock:
        if "ok" not in _state:
            if os.environ.get("KILN_DISABLE_CPU_KERNELS"):
                _state["ok"] = False
            else:
                try:
                    _build()
                    _state["ok"] = hasattr(torch.ops.kiln, "paged_attention")
                except Exception as exc:  # a missing compiler must not stop the engine
                    log.warning("kiln CPU kernels unavailable (%s); using the torch reference "
                                "path", str(exc).splitlines()[0] if str(exc) else type(exc))
                    _state["ok"] = False
        return _state["ok"]
