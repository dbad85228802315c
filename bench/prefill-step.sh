#!/usr/bin/env bash
# Prompts arriving while others decode: `kura serve --prefill-step-ms` (the prompt tokens of a step beside
# decodes cut to about that many milliseconds) against no cut (`--prefill-step-ms 0`, a step takes up to
# --max-num-batched-tokens), the settings interleaved round by round on one machine. Each run is a fresh
# server (default model, THREADS threads) and `kura bench unique` sending REQUESTS prompts of PROMPT tokens
# at Poisson arrivals of RATE a second (open loop: arrivals fall between other requests' decodes, as a
# real service's do), OUTPUT tokens each. Prints TTFT and ITL p50/p99 and output tokens/s per setting,
# medians over the rounds with their ranges, and writes $OUT/table.md.
#
#   bench/prefill-step.sh [OUT]  (STEPS="0 250" ROUNDS=3 RATE=0.5 REQUESTS=16 PROMPT=1050 OUTPUT=64
#                                 THREADS=2 PORT=8031 KURA_BIN=...)
set -euo pipefail

OUT=${1:-/tmp/kura-prefill-step}
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/.." && pwd)
STEPS=${STEPS:-0 250}
ROUNDS=${ROUNDS:-3}
RATE=${RATE:-0.5}
REQUESTS=${REQUESTS:-16}
PROMPT=${PROMPT:-1050}
OUTPUT=${OUTPUT:-64}
THREADS=${THREADS:-2}
PORT=${PORT:-8031}
for v in ROUNDS REQUESTS PROMPT OUTPUT THREADS PORT; do
  case "${!v}" in '' | *[!0-9]* | 0) echo "prefill-step: $v must be a whole number of at least 1, got '${!v}'" >&2; exit 2 ;; esac
done
for s in $STEPS; do
  case "$s" in '' | *[!0-9]*) echo "prefill-step: STEPS are milliseconds (0: no cut), got '$s'" >&2; exit 2 ;; esac
done
KURA=${KURA_BIN:-$REPO/target/release/kura}
if [ -z "${KURA_BIN:-}" ]; then
  (cd "$REPO" && cargo build --release -q -p kura)
fi
[ -x "$KURA" ] || { echo "prefill-step: $KURA is not an executable" >&2; exit 1; }
MODEL=$("$REPO/scripts/fetch-model.sh")
mkdir -p "$OUT"
URL="http://127.0.0.1:$PORT"

SERVER_PID=""
stop_server() {
  if [ -n "$SERVER_PID" ]; then
    kill "$SERVER_PID" 2>/dev/null || true
    wait "$SERVER_PID" 2>/dev/null || true
    SERVER_PID=""
  fi
}
trap stop_server EXIT

for round in $(seq 1 "$ROUNDS"); do
  for step in $STEPS; do
    run="$OUT/step-$step/round-$round"
    mkdir -p "$run"
    if curl -fsS -m 2 "$URL/health" >/dev/null 2>&1; then
      echo "prefill-step: another server answers on port $PORT; stop it or set PORT" >&2
      exit 1
    fi
    "$KURA" serve --model "$MODEL" --host 127.0.0.1 --port "$PORT" --threads "$THREADS" \
      --prefill-step-ms "$step" >"$run/serve.log" 2>&1 &
    SERVER_PID=$!
    for _ in $(seq 1 600); do
      curl -fsS -m 2 "$URL/health" >/dev/null 2>&1 && break
      kill -0 "$SERVER_PID" 2>/dev/null || { echo "prefill-step: server exited, see $run/serve.log" >&2; exit 1; }
      sleep 0.5
    done
    curl -fsS -m 2 "$URL/health" >/dev/null || { echo "prefill-step: server not healthy, see $run/serve.log" >&2; exit 1; }
    "$KURA" bench unique --url "$URL" --requests "$REQUESTS" --prompt-tokens "$PROMPT" \
      --output-tokens "$OUTPUT" --rate "$RATE" --seed "$round" --out "$run" >"$run/bench.log" 2>&1 \
      || { echo "prefill-step: kura bench failed, see $run/bench.log" >&2; exit 1; }
    curl -fsS -m 5 "$URL/metrics" >"$run/metrics.txt"
    stop_server
    echo "prefill-step: round $round, --prefill-step-ms $step done" >&2
  done
done

python3 - "$OUT" "$ROUNDS" $STEPS <<'EOF'
import json, statistics, sys
out, rounds, steps = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
cols = [("ttft_ms", "p50"), ("ttft_ms", "p99"), ("itl_ms", "p50"), ("itl_ms", "p99"), ("itl_ms", "max")]

def summary(step, r):
    return json.load(open(f"{out}/step-{step}/round-{r}/run.json"))["points"][0]["summary"]

def cell(vs, fmt):
    return f"{statistics.median(vs):{fmt}} ({min(vs):{fmt}}–{max(vs):{fmt}})"

rows = [
    "| --prefill-step-ms | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | ITL max ms | out tok/s |",
    "|---:|---:|---:|---:|---:|---:|---:|",
]
for s in steps:
    sums = [summary(s, r) for r in range(1, rounds + 1)]
    for x in sums:
        if x["failed"]:
            sys.exit(f"prefill-step: {x['failed']} requests failed at --prefill-step-ms {s}")
    cells = [cell([x[k][q] for x in sums], ",.0f") for k, q in cols]
    cells.append(cell([x["output_tok_per_s"] for x in sums], ".1f"))
    rows.append(f"| {'0 (no cut)' if s == '0' else s} | " + " | ".join(cells) + " |")
table = "\n".join(rows)
open(f"{out}/table.md", "w").write(table + "\n")
print(table)
EOF
