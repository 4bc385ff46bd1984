#!/usr/bin/env bash
# Install the llama.cpp peer (llama-cpp-python, built from its sdist for this CPU) in its own
# virtualenv /work/main/peers/llamacpp-venv (git-ignored), never kiln's .venv, and keep the
# unpacked sdist, whose vendor/llama.cpp holds convert_hf_to_gguf.py and gguf-py, at
# /work/main/peers/llama_cpp_python-$VERSION. Idempotent: finished steps are skipped.
#   usage: benchmarks/peers/setup_llamacpp.sh    (about 5 minutes of compiling on 2 cores)
#   env:   PEERS_DIR (default <repo>/peers), PYTHON (default python3), FORCE=1 to rebuild
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PEERS_DIR="${PEERS_DIR:-$REPO/peers}"
VENV="$PEERS_DIR/llamacpp-venv"
PYTHON="${PYTHON:-python3}"
VERSION="0.3.36"
DL="$PEERS_DIR/dl"
SDIST="$DL/llama_cpp_python-$VERSION.tar.gz"
SRC="$PEERS_DIR/llama_cpp_python-$VERSION"          # unpacked sdist (top dir of the tarball)
LLAMA_DIR="$SRC/vendor/llama.cpp"                    # convert_hf_to_gguf.py, gguf-py/
STAMP="$VENV/.kiln-peer-llamacpp-$VERSION"

mkdir -p "$PEERS_DIR" "$DL"
if [[ -f "$STAMP" && -f "$LLAMA_DIR/convert_hf_to_gguf.py" && "${FORCE:-0}" != 1 ]]; then
  echo "llama-cpp-python $VERSION already installed in $VENV (FORCE=1 to rebuild)"
  echo "vendored llama.cpp: $LLAMA_DIR"
  exit 0
fi

test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
PY="$VENV/bin/python"
"$PY" -m pip install -q --upgrade pip

# 1. The source distribution (no prebuilt wheel: build for this CPU).
if [[ ! -f "$SDIST" ]]; then
  rm -rf "$DL/partial"
  "$PY" -m pip download "llama-cpp-python==$VERSION" --no-deps --no-binary :all: -d "$DL/partial"
  mv "$DL/partial/$(basename "$SDIST")" "$SDIST"
  rm -rf "$DL/partial"
fi
# 2. Keep it unpacked: the vendored llama.cpp has the HF -> GGUF converter and gguf-py.
if [[ ! -f "$LLAMA_DIR/convert_hf_to_gguf.py" ]]; then
  rm -rf "$SRC"
  tar -xzf "$SDIST" -C "$PEERS_DIR"
fi
# 3. Build and install (CPU backend, native flags; about 5 minutes on 2 cores).
#    The [server] extra adds the OpenAI-compatible server's pure-Python deps (from PyPI).
if [[ "${FORCE:-0}" == 1 ]] || ! "$PY" -c "import llama_cpp; assert llama_cpp.__version__ == '$VERSION'" 2>/dev/null; then
  REINSTALL=(); [[ "${FORCE:-0}" == 1 ]] && REINSTALL=(--force-reinstall)
  CMAKE_BUILD_PARALLEL_LEVEL=2 "$PY" -m pip install --no-cache-dir "${REINSTALL[@]}" \
    "llama_cpp_python[server] @ file://$SDIST"
fi
# 4. Server extra again, by name, in case an earlier run built llama_cpp without it (a no-op
#    otherwise: the installed, locally built llama_cpp satisfies the pin and is kept).
"$PY" -m pip install "llama-cpp-python[server]==$VERSION"
# 5. Converter deps: the vendored gguf-py (matches the converter), torch (CPU wheel from this
#    machine's disk; the converter imports it), transformers for the tokenizer, sentencepiece.
"$PY" -m pip install torch==2.13.0
"$PY" -m pip install "$LLAMA_DIR/gguf-py" transformers sentencepiece safetensors

"$PY" - <<PY
import llama_cpp
print("llama_cpp", llama_cpp.__version__, "system info:", llama_cpp.llama_print_system_info().decode())
assert llama_cpp.__version__ == "$VERSION"
PY
touch "$STAMP"
echo "llama-cpp-python $VERSION ready: $PY"
echo "vendored llama.cpp: $LLAMA_DIR"
