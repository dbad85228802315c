#!/usr/bin/env bash
# The engine loop's time outside the forward pass (scheduling, sampling, detokenization, stop checks,
# logprob texts, emitting), per step, from `kura serve`'s own counters: STREAMS (8) concurrent chat
# requests of 64 tokens, greedy, then at the API's default temperature (1), then with 20 top logprobs each and a stop
# string that never matches; and the decode tokens/s of each run.
#
#   bench/engine-overhead.sh          (THREADS=2 STREAMS=8 PORT=8012 KURA_BIN=...)
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/.." && pwd)
THREADS=${THREADS:-2}
STREAMS=${STREAMS:-8}
PORT=${PORT:-8012}
KURA=${KURA_BIN:-$REPO/target/release/kura}
if [ -z "${KURA_BIN:-}" ]; then
  (cd "$REPO" && cargo build --release -p kura >&2)
fi
URL="http://127.0.0.1:$PORT"
LOG=$(mktemp)
"$KURA" serve --host 127.0.0.1 --port "$PORT" --threads "$THREADS" >"$LOG" 2>&1 &
PID=$!
trap 'kill $PID 2>/dev/null || true; wait $PID 2>/dev/null || true; rm -f "$LOG"' EXIT
for _ in $(seq 1 600); do
  curl -fsS -m 2 "$URL/health" >/dev/null 2>&1 && break
  kill -0 "$PID" 2>/dev/null || { cat "$LOG" >&2; exit 1; }
  sleep 0.5
done

metric() { curl -fsS "$URL/metrics" | awk -v n="$1" '$1 == n { print $2 }'; }

run() { # label extra-json
  local steps0 fwd0 other0
  steps0=$(metric kura:engine_steps_total)
  fwd0=$(metric kura:engine_forward_seconds_total)
  other0=$(metric kura:engine_step_other_seconds_total)
  local t0 gen0
  t0=$(date +%s.%N)
  gen0=$(metric kura:generation_tokens_total)
  for i in $(seq 1 "$STREAMS"); do
    curl -fsS "$URL/v1/chat/completions" -H 'content-type: application/json' -d "{
      \"messages\": [{\"role\": \"user\", \"content\": \"Tell story number $i about a cache.\"}],
      \"max_tokens\": 64, \"ignore_eos\": true $2}" >/dev/null &
  done
  wait $(jobs -p | grep -v "^$PID\$") 2>/dev/null || true
  local steps fwd other t1 gen
  t1=$(date +%s.%N)
  gen=$(metric kura:generation_tokens_total)
  steps=$(metric kura:engine_steps_total)
  fwd=$(metric kura:engine_forward_seconds_total)
  other=$(metric kura:engine_step_other_seconds_total)
  awk -v l="$1" -v s="$steps" -v s0="$steps0" -v f="$fwd" -v f0="$fwd0" -v o="$other" -v o0="$other0" \
    -v t0="$t0" -v t1="$t1" -v g="$gen" -v g0="$gen0" 'BEGIN {
    n = s - s0; printf "%-40s %4d steps, forward %.2f ms/step, outside the forward pass %.0f us/step (%.1f %%), %.0f tokens/s\n",
      l, n, (f - f0) * 1e3 / n, (o - o0) * 1e6 / n, 100 * (o - o0) / ((f - f0) + (o - o0)), (g - g0) / (t1 - t0) }'
}

echo "load $(cut -d' ' -f1-3 /proc/loadavg), $THREADS threads, $STREAMS streams"
for r in 1 2 3; do
  run "greedy (run $r)" ', "temperature": 0'
  run "plain (run $r)" ""
  run "20 top logprobs + stop string (run $r)" ', "logprobs": true, "top_logprobs": 20, "stop": ["never-in-the-output"]'
done
