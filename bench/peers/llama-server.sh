#!/usr/bin/env bash
# Starts llama.cpp's llama-server (built by build-llama-cpp.sh) on Kura's default model, on a loopback
# port, with prompt caching on, and waits until GET /health answers 200. Prints the server's URL.
#
#   bench/peers/llama-server.sh [start]   start (idempotent: a healthy server on the port is reused)
#   bench/peers/llama-server.sh stop      stop the server this script started on the port
#
# Environment: PORT (8090), MODEL (default: scripts/fetch-model.sh), PARALLEL slots (8), CTX total
# context shared by the slots (16384, one unified KV buffer), THREADS (all cores), EXTRA_ARGS.
# The log and pid file are under ${KURA_CACHE_DIR:-~/.cache/kura}/peers/run/.
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
PORT="${PORT:-8090}"
PARALLEL="${PARALLEL:-8}"
CTX="${CTX:-16384}"
THREADS="${THREADS:-$(nproc)}"
RUN="${KURA_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/kura}/peers/run"
PIDFILE="$RUN/llama-server-$PORT.pid"
LOG="$RUN/llama-server-$PORT.log"
URL="http://127.0.0.1:$PORT"
mkdir -p "$RUN"

healthy() { curl -fsS -m 2 "$URL/health" >/dev/null 2>&1; }

case "${1:-start}" in
  stop)
    if [ -f "$PIDFILE" ]; then
      pid=$(cat "$PIDFILE")
      if kill -0 "$pid" 2>/dev/null; then
        kill "$pid"
        for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
      fi
      rm -f "$PIDFILE"
      echo "llama-server on port $PORT stopped" >&2
    else
      echo "llama-server.sh: no server started by this script on port $PORT" >&2
    fi
    exit 0
    ;;
  start) ;;
  *) echo "usage: $0 [start|stop]" >&2; exit 2 ;;
esac

if healthy; then
  echo "$URL"
  exit 0
fi

BIN=$("$HERE/build-llama-cpp.sh")
MODEL="${MODEL:-$("$REPO/scripts/fetch-model.sh")}"
[ -f "$MODEL" ] || { echo "llama-server.sh: model file $MODEL not found" >&2; exit 1; }

# shellcheck disable=SC2086
nohup "$BIN/llama-server" -m "$MODEL" --host 127.0.0.1 --port "$PORT" \
  -c "$CTX" -np "$PARALLEL" --kv-unified --cache-prompt -t "$THREADS" --no-webui --metrics \
  ${EXTRA_ARGS:-} >"$LOG" 2>&1 &
echo $! >"$PIDFILE"

for _ in $(seq 240); do
  if healthy; then
    echo "$URL"
    exit 0
  fi
  if ! kill -0 "$(cat "$PIDFILE")" 2>/dev/null; then
    echo "llama-server.sh: llama-server exited during start-up; last lines of $LOG:" >&2
    tail -20 "$LOG" >&2
    rm -f "$PIDFILE"
    exit 1
  fi
  sleep 0.5
done
echo "llama-server.sh: $URL/health not ready after 120 s; see $LOG" >&2
exit 1
