#!/usr/bin/env bash
# Resident memory of `kura serve` on the default model with each weights format: starts the server with a
# small KV cache, waits for /health, sends one request, and reads VmRSS from /proc. Prints a markdown list.
#
# Usage: bench/serve-rss.sh
# Environment: WEIGHTS ["native bf16 f32"]  KV ["64MiB"]  MODEL [scripts/fetch-model.sh]
#   KURA_BIN [target/release/kura]
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/.." && pwd)
WEIGHTS="${WEIGHTS:-native bf16 f32}"
KV="${KV:-64MiB}"
MODEL="${MODEL:-$("$REPO/scripts/fetch-model.sh")}"
KURA="${KURA_BIN:-$REPO/target/release/kura}"
if [ -z "${KURA_BIN:-}" ]; then
    (cd "$REPO" && cargo build --release -q -p kura)
fi
PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')

echo "Resident memory of \`kura serve --kv-cache-memory $KV\` after one request ($(basename "$MODEL")):"
echo
for w in $WEIGHTS; do
    "$KURA" serve --model "$MODEL" --served-model-name m --weights-dtype "$w" --kv-cache-memory "$KV" --port "$PORT" \
        --threads 2 >/dev/null 2>&1 &
    pid=$!
    for _ in $(seq 600); do
        curl -sf "http://127.0.0.1:$PORT/health" >/dev/null 2>&1 && break
        sleep 0.1
    done
    curl -sf "http://127.0.0.1:$PORT/v1/completions" -H 'Content-Type: application/json' \
        -d '{"model": "m", "prompt": "The capital of France is", "max_tokens": 8}' >/dev/null
    rss_kb=$(awk '/^VmRSS/ {print $2}' "/proc/$pid/status")
    kill "$pid"
    wait "$pid" 2>/dev/null || true
    echo "- weights $w: $((rss_kb / 1024)) MiB"
done
