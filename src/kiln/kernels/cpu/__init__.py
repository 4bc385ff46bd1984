"""kiln's C++ CPU kernels, one source file per op family, compiled on first use with torch's
extension tooling.

`load()` builds every `*.cpp` here into one library (once per machine and version of the
sources; cached under $TORCH_EXTENSIONS_DIR, by default ~/.cache/torch_extensions) and
registers the ops as `torch.ops.kiln.*` (ops.cpp holds the one registration block). If the
build fails (no compiler, no ninja) it logs one line and returns False: callers then use the
plain torch reference path, which every kernel is tested against (tests/kernels/).
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import sys
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)
_lock = threading.Lock()
_state: dict[str, bool] = {}

HERE = Path(__file__).parent.resolve()
SOURCES = sorted(HERE.glob("*.cpp"))
HEADERS = sorted(HERE.glob("*.h"))
FLAGS = ["-O3", "-fopenmp", "-march=native", "-ffast-math", "-fno-finite-math-only"]


def build_directory() -> Path:
    """Where the kernels build: one directory per set of sources (paths and contents, headers
    included), flags, Python and torch (two kiln checkouts on one machine, a CI clone beside a
    work tree, would otherwise rebuild one directory in turn, ninja recording the sources'
    paths, and load each other's library)."""
    from torch.utils.cpp_extension import get_default_build_root

    digest = hashlib.sha256()
    for part in [" ".join(FLAGS), sys.version, torch.__version__]:
        digest.update(part.encode() + b"\0")
    for path in SOURCES + HEADERS:
        digest.update(str(path).encode() + b"\0" + path.read_bytes() + b"\0")
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())
    return root / "kiln" / f"kiln_cpu_kernels_{digest.hexdigest()[:12]}"


def _build() -> None:
    from torch.utils.cpp_extension import load

    build_dir = build_directory()
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / "kiln.lock", "w") as held:
        # torch's own build lock is a plain file: a build killed midway leaves it behind and
        # every later process waits for it forever. An flock dies with its process, so once
        # we hold ours, any torch lock file there is stale
        fcntl.flock(held, fcntl.LOCK_EX)
        (build_dir / "lock").unlink(missing_ok=True)
        load(name=build_dir.name, sources=[str(s) for s in SOURCES], extra_cflags=FLAGS,
             extra_ldflags=["-fopenmp"], build_directory=str(build_dir),
             is_python_module=False, verbose=False)


def load() -> bool:
    """Build and register the kernels once; True if `torch.ops.kiln` is usable."""
    with _lock:
        if "ok" not in _state:
            if os.environ.get("KILN_DISABLE_CPU_KERNELS"):
                _state["ok"] = False
            else:
                from kiln.kernels.isa import int8_wide_min_tokens, stream_ahead, vnni_stream_ahead

                # this CPU's tuning (decisions 0024, 0025); a bad override raises
                ahead, wide = stream_ahead(), int8_wide_min_tokens()
                try:
                    _build()
                    _state["ok"] = hasattr(torch.ops.kiln, "paged_attention")
                except Exception as exc:  # a missing compiler must not stop the engine
                    log.warning("kiln CPU kernels unavailable (%s); using the torch reference "
                                "path", str(exc).splitlines()[0] if str(exc) else type(exc))
                    _state["ok"] = False
                if _state["ok"]:
                    vnni_stream_ahead(ahead)
                    torch.ops.kiln.set_int8_wide_min_tokens(wide)
        return _state["ok"]
