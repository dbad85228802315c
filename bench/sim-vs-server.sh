#!/usr/bin/env bash
# The simulator against the server it simulates, same workloads, same machine, one run:
#   1. `kura sim --calibrate` times forward steps of the default model and fits the cost model;
#   2. per workload, a fresh `kura serve` (f32 KV, 1 GiB pool; 512 MiB for the concurrency sweep) is
#      measured with `kura bench` and its pool's block count read from its log;
#   3. `kura sim --workload ...` predicts the same runs with that pool and that cost model;
#   4. a markdown table of predicted vs measured (TTFT p50, ITL p50, output tokens/s, ratio sim/measured)
#      goes to $OUT/table.md.
#
#   bench/sim-vs-server.sh [OUT]       (THREADS=2 SWEEP=1,2,4,8,12,16,24 PORT=8011 KURA_BIN=...)
set -euo pipefail

OUT=${1:-/tmp/kura-sim-vs-server}
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/.." && pwd)
THREADS=${THREADS:-2}
PORT=${PORT:-8011}
SWEEP=${SWEEP:-1,2,4,8,12,16,24}
SEED=${SEED:-0}
OUTPUT_TOKENS=${OUTPUT_TOKENS:-64}
KURA=${KURA_BIN:-$REPO/target/release/kura}
if [ -z "${KURA_BIN:-}" ]; then
  (cd "$REPO" && cargo build --release -p kura >&2)
fi
mkdir -p "$OUT/measured" "$OUT/sim"
URL="http://127.0.0.1:$PORT"

echo "sim-vs-server: load $(cut -d' ' -f1-3 /proc/loadavg)" >&2
"$KURA" sim --calibrate --threads "$THREADS" --kv-dtype f32 --cost "$OUT/cost.json" 2>"$OUT/calibrate.log"
tail -2 "$OUT/calibrate.log" >&2

SERVER_PID=""
stop_server() {
  if [ -n "$SERVER_PID" ]; then
    kill "$SERVER_PID" 2>/dev/null || true
    wait "$SERVER_PID" 2>/dev/null || true
    SERVER_PID=""
  fi
}
trap stop_server EXIT

start_server() { # kv-memory log; sets SERVER_PID and BLOCKS
  if curl -fsS -m 2 "$URL/health" >/dev/null 2>&1; then
    echo "sim-vs-server: another server answers on port $PORT; stop it or set PORT" >&2
    exit 1
  fi
  "$KURA" serve --host 127.0.0.1 --port "$PORT" --threads "$THREADS" --kv-dtype f32 \
    --kv-cache-memory "$1" >"$2" 2>&1 &
  SERVER_PID=$!
  for _ in $(seq 1 600); do
    if curl -fsS -m 2 "$URL/health" >/dev/null 2>&1; then
      BLOCKS=$(sed -n 's/.*KV cache: \([0-9]*\) blocks.*/\1/p' "$2" | head -1)
      [ -n "$BLOCKS" ] || { echo "sim-vs-server: no block count in $2" >&2; exit 1; }
      return 0
    fi
    kill -0 "$SERVER_PID" 2>/dev/null || { echo "sim-vs-server: server exited, see $2" >&2; exit 1; }
    sleep 0.5
  done
  echo "sim-vs-server: server not healthy after 300 s, see $2" >&2
  exit 1
}

workload_args() {
  case "$1" in
    shared-prefix) echo "--groups 4 --users-per-group 8 --system-tokens 1000 --question-tokens 50" ;;
    multi-turn) echo "--conversations 8 --turns 4 --system-tokens 200 --user-tokens 100" ;;
    unique) echo "--requests 32 --prompt-tokens 1050" ;;
  esac
}

for wl in shared-prefix multi-turn unique; do
  start_server 1GiB "$OUT/measured/$wl.log"
  # shellcheck disable=SC2046
  "$KURA" bench "$wl" $(workload_args "$wl") --url "$URL" --label kura --seed "$SEED" \
    --concurrency 8 --output-tokens "$OUTPUT_TOKENS" --out "$OUT/measured/$wl" >/dev/null
  stop_server
  # shellcheck disable=SC2046
  "$KURA" sim --workload "$wl" $(workload_args "$wl") --concurrency 8 --kv-blocks "$BLOCKS" \
    --output-tokens "$OUTPUT_TOKENS" --cost "$OUT/cost.json" --json >"$OUT/sim/$wl.json"
  echo "sim-vs-server: $wl done ($BLOCKS blocks)" >&2
done

start_server 512MiB "$OUT/measured/sweep.log"
"$KURA" bench unique --requests 24 --prompt-tokens 1050 --url "$URL" --label kura --seed "$SEED" \
  --sweep-concurrency "$SWEEP" --output-tokens "$OUTPUT_TOKENS" --out "$OUT/measured/sweep" >/dev/null
stop_server
"$KURA" sim --workload unique --requests 24 --prompt-tokens 1050 --concurrency "$SWEEP" \
  --kv-blocks "$BLOCKS" --output-tokens "$OUTPUT_TOKENS" --cost "$OUT/cost.json" --json >"$OUT/sim/sweep.json"
echo "sim-vs-server: sweep done ($BLOCKS blocks)" >&2

python3 - "$OUT" <<'EOF' | tee "$OUT/table.md"
import json, sys
out = sys.argv[1]
def rows(name):
    measured = json.load(open(f"{out}/measured/{name}/run.json"))
    sim = json.load(open(f"{out}/sim/{name}.json"))
    for m, s in zip(measured["points"], sim["points"]):
        ms = m["summary"]
        yield (m["load"].get("concurrency"), ms, s)
print("| workload | clients | TTFT p50 ms sim / measured | ITL p50 ms sim / measured | out tok/s sim / measured | cached sim / measured | preemptions sim |")
print("|---|---:|---:|---:|---:|---:|---:|")
def cell(a, b):
    return f"{a:,.1f} / {b:,.1f} ({a / b:.2f})" if b else f"{a:,.1f} / –"
for name in ["shared-prefix", "multi-turn", "unique", "sweep"]:
    for conc, m, s in rows(name):
        label = "unique (512 MiB)" if name == "sweep" else name
        print(f"| {label} | {conc} | {cell(s['ttft_ms']['p50'], m['ttft_ms']['p50'])} | "
              f"{cell(s['itl_ms']['p50'], m['itl_ms']['p50'])} | "
              f"{cell(s['output_tokens_per_s'], m['output_tok_per_s'])} | "
              f"{s['cached_ratio'] * 100:.1f} % / {(m.get('cached_token_ratio') or 0) * 100:.1f} % | {s['preemptions']} |")
EOF
