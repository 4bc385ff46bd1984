#!/usr/bin/env bash
# Start llama-cpp-python's OpenAI-compatible server (the [server] extra) on kiln's default model
# as GGUF, in the background, and return once GET /v1/models answers 200 (it has no /health).
#   usage: benchmarks/peers/serve_llamacpp.sh [PORT] [bf16|q8_0]   start (default 8012, bf16)
#          benchmarks/peers/serve_llamacpp.sh stop [PORT]          stop the server on PORT
#   env:   THREADS (default 2), N_CTX (default 2048), PEERS_DIR, GGUF (a .gguf path, overrides)
# Limits of this server (0.3.36): one sequence at a time (requests are serialized: a batch-1 peer
# only); no `ignore_eos` (send min_tokens = max_tokens instead); no
# stream_options.include_usage (streamed chunks carry no usage).
# Log: $PEERS_DIR/run/llamacpp-PORT.log; pid in $PEERS_DIR/run/llamacpp-PORT.pid.
# Needs benchmarks/peers/setup_llamacpp.sh and benchmarks/peers/make_gguf.sh first.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PEERS_DIR="${PEERS_DIR:-$REPO/peers}"
PY="$PEERS_DIR/llamacpp-venv/bin/python"
NAME="SmolLM2-135M-Instruct"
RUN="$PEERS_DIR/run"

ACTION=start PORT=8012 TYPE=bf16
for a in "$@"; do
  case "$a" in
    stop) ACTION=stop ;;
    bf16|q8_0) TYPE="$a" ;;
    ''|*[!0-9]*) echo "usage: $0 [PORT] [bf16|q8_0] | $0 stop [PORT]" >&2; exit 2 ;;
    *) PORT="$a" ;;
  esac
done
GGUF="${GGUF:-$PEERS_DIR/gguf/$NAME-$TYPE.gguf}"
PIDF="$RUN/llamacpp-$PORT.pid" LOG="$RUN/llamacpp-$PORT.log"
URL="http://127.0.0.1:$PORT"
mkdir -p "$RUN"

alive() { [[ -f "$PIDF" ]] && kill -0 "$(cat "$PIDF")" 2>/dev/null; }
healthy() { [[ "$(curl -s -o /dev/null -w '%{http_code}' --max-time 5 "$URL/v1/models" || true)" == 200 ]]; }

if [[ "$ACTION" == stop ]]; then
  if alive; then
    pid="$(cat "$PIDF")"
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 40); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
    kill -KILL "$pid" 2>/dev/null || true
    echo "llama.cpp server on port $PORT stopped"
  else
    echo "no llama.cpp server started by this script on port $PORT"
  fi
  rm -f "$PIDF"
  exit 0
fi

test -x "$PY" || { echo "run benchmarks/peers/setup_llamacpp.sh first" >&2; exit 1; }
test -f "$GGUF" || { echo "no $GGUF: run benchmarks/peers/make_gguf.sh first" >&2; exit 1; }
if alive && healthy; then echo "llama.cpp already serving at $URL (pid $(cat "$PIDF"))"; exit 0; fi
if healthy; then echo "port $PORT already serves something else; pick another port" >&2; exit 1; fi

THREADS="${THREADS:-2}"
"$PY" -m llama_cpp.server --model "$GGUF" --model_alias "$NAME" \
  --host 127.0.0.1 --port "$PORT" --n_ctx "${N_CTX:-2048}" \
  --n_threads "$THREADS" --n_threads_batch "$THREADS" >"$LOG" 2>&1 </dev/null &
echo $! >"$PIDF"
echo "llama.cpp server starting (pid $!, $(basename "$GGUF"), $THREADS threads), log $LOG"

deadline=$((SECONDS + ${HEALTH_TIMEOUT:-120}))
until healthy; do
  if ! alive; then echo "server exited during start-up; last log lines:" >&2; tail -n 30 "$LOG" >&2; rm -f "$PIDF"; exit 1; fi
  if (( SECONDS > deadline )); then echo "not ready after ${HEALTH_TIMEOUT:-120} s; see $LOG" >&2; exit 1; fi
  sleep 1
done
echo "llama.cpp healthy at $URL (model name $NAME) after ${SECONDS} s; stop with: $0 stop $PORT"
