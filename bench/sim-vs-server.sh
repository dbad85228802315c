#!/usr/bin/env bash
# The simulator against the server it simulates, same workloads, same machine. REPEATS rounds, each:
#   1. `kura sim --calibrate` times forward steps of the default model and fits a cost model;
#   2. per workload (shared-prefix, multi-turn, unique), a fresh `kura serve` (f32 KV, 1 GiB pool) is
#      measured with `kura bench` and its pool's block count read from its log, and `kura sim --workload`
#      predicts the same run with that pool and that round's cost model;
#   3. a second calibration, then the concurrency sweep (a fresh server with a 512 MiB pool) and its
#      prediction.
# Each prediction uses a cost model timed minutes before the run it predicts: this machine is shared, and
# its speed moves by up to a third over tens of minutes (decode steps of long contexts, which read the
# most memory, move the most), so a cost model timed once is not the machine of a run half an hour later.
# A markdown table goes to $OUT/table.md: TTFT p50 and mean, ITL mean and output tokens/s (the four
# counted), ITL p50 and p99, each the median over the rounds of the simulated and of the measured figure,
# their ratio, and the measured rounds' range. One closed-loop run's TTFT median also flips between modes
# from run to run (the waves of equal requests split differently), so a single run is not a measurement
# of it; its mean is steadier. The ITL counted is the mean, not the median: with the prefill cut
# (--prefill-step-ms) a token comes after either a decode step or a cut prompt step, and the median falls
# on one mode or the other with a few per cent of either's share, where the mean moves with the share.
#
#   bench/sim-vs-server.sh [OUT]  (THREADS=2 REPEATS=3 SWEEP=1,2,4,8,12,16,24 PORT=8011 KURA_BIN=...)
set -euo pipefail

OUT=${1:-/tmp/kura-sim-vs-server}
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/.." && pwd)
THREADS=${THREADS:-2}
PORT=${PORT:-8011}
SWEEP=${SWEEP:-1,2,4,8,12,16,24}
SEED=${SEED:-0}
REPEATS=${REPEATS:-3}
[ "$REPEATS" -ge 1 ] 2>/dev/null || { echo "sim-vs-server: REPEATS must be a number >= 1" >&2; exit 1; }
OUTPUT_TOKENS=${OUTPUT_TOKENS:-64}
KURA=${KURA_BIN:-$REPO/target/release/kura}
if [ -z "${KURA_BIN:-}" ]; then
  (cd "$REPO" && cargo build --release -p kura >&2)
fi
mkdir -p "$OUT/measured" "$OUT/sim" "$OUT/cost"
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

calibrate() { # name
  "$KURA" sim --calibrate --threads "$THREADS" --kv-dtype f32 --cost "$OUT/cost/$1.json" \
    2>"$OUT/cost/$1.log"
  echo "sim-vs-server: calibrated $1 ($(tail -2 "$OUT/cost/$1.log" | head -1 | sed 's/^fit: //'))" >&2
}

workload_args() {
  case "$1" in
    shared-prefix) echo "--groups 4 --users-per-group 8 --system-tokens 1000 --question-tokens 50" ;;
    multi-turn) echo "--conversations 8 --turns 4 --system-tokens 200 --user-tokens 100" ;;
    unique) echo "--requests 32 --prompt-tokens 1050" ;;
  esac
}

for r in $(seq 1 "$REPEATS"); do
  echo "sim-vs-server: round $r of $REPEATS, load $(cut -d' ' -f1-3 /proc/loadavg)" >&2
  calibrate "$r-workloads"
  for wl in shared-prefix multi-turn unique; do
    start_server 1GiB "$OUT/measured/$wl-$r.log"
    # shellcheck disable=SC2046
    "$KURA" bench "$wl" $(workload_args "$wl") --url "$URL" --label kura --seed "$SEED" \
      --concurrency 8 --output-tokens "$OUTPUT_TOKENS" --out "$OUT/measured/$wl-$r" >/dev/null
    stop_server
    # shellcheck disable=SC2046
    "$KURA" sim --workload "$wl" $(workload_args "$wl") --concurrency 8 --kv-blocks "$BLOCKS" \
      --output-tokens "$OUTPUT_TOKENS" --cost "$OUT/cost/$r-workloads.json" --json >"$OUT/sim/$wl-$r.json"
    echo "sim-vs-server: $wl done ($BLOCKS blocks)" >&2
  done
  calibrate "$r-sweep"
  start_server 512MiB "$OUT/measured/sweep-$r.log"
  "$KURA" bench unique --requests 24 --prompt-tokens 1050 --url "$URL" --label kura --seed "$SEED" \
    --sweep-concurrency "$SWEEP" --output-tokens "$OUTPUT_TOKENS" --out "$OUT/measured/sweep-$r" >/dev/null
  stop_server
  "$KURA" sim --workload unique --requests 24 --prompt-tokens 1050 --concurrency "$SWEEP" \
    --kv-blocks "$BLOCKS" --output-tokens "$OUTPUT_TOKENS" --cost "$OUT/cost/$r-sweep.json" \
    --json >"$OUT/sim/sweep-$r.json"
  echo "sim-vs-server: sweep done ($BLOCKS blocks)" >&2
done

python3 - "$OUT" "$REPEATS" <<'EOF' | tee "$OUT/table.md"
import json, statistics, sys
out, repeats = sys.argv[1], int(sys.argv[2])
rounds = range(1, repeats + 1)
def rows(name):
    measured = [json.load(open(f"{out}/measured/{name}-{r}/run.json"))["points"] for r in rounds]
    sim = [json.load(open(f"{out}/sim/{name}-{r}.json"))["points"] for r in rounds]
    for k in range(len(sim[0])):
        yield (measured[0][k]["load"].get("concurrency"), [m[k]["summary"] for m in measured],
               [s[k] for s in sim])
def cell(a_s, b_s, digits=1):
    a, b = statistics.median(a_s), statistics.median(b_s)
    if not b:
        return f"{a:,.{digits}f} / –"
    spread = f"; {min(b_s):,.{digits}f}–{max(b_s):,.{digits}f}" if len(b_s) > 1 else ""
    return f"{a:,.{digits}f} / {b:,.{digits}f} ({a / b:.2f}{spread})"
print(f"Each figure the median over {repeats} rounds (each round: a calibration, then a fresh server per "
      "workload); in brackets the ratio sim / measured and the measured rounds' range. Counted: TTFT p50 "
      "and mean, ITL mean, out tok/s.\n")
print("| workload | clients | TTFT p50 ms sim / measured | TTFT mean ms | ITL mean ms | out tok/s | ITL p50 ms | ITL p99 ms | cached sim / measured | preemptions sim |")
print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
within = total = 0
for name in ["shared-prefix", "multi-turn", "unique", "sweep"]:
    for conc, ms, ss in rows(name):
        label = "unique (512 MiB)" if name == "sweep" else name
        itl = lambda key: ([s["itl_ms"][key] for s in ss], [m["itl_ms"][key] for m in ms])
        ttft = lambda key: ([s["ttft_ms"][key] for s in ss], [m["ttft_ms"][key] for m in ms])
        counted = [ttft("p50"), ttft("mean"), itl("mean"),
                   ([s["output_tokens_per_s"] for s in ss], [m["output_tok_per_s"] for m in ms])]
        for a_s, b_s in counted:
            total += 1
            a, b = statistics.median(a_s), statistics.median(b_s)
            within += bool(b) and abs(a / b - 1) <= 0.2
        cached = statistics.median([(m.get("cached_token_ratio") or 0) for m in ms])
        sim_cached = statistics.median([s["cached_ratio"] for s in ss])
        preempted = max(s["preemptions"] for s in ss)
        print(f"| {label} | {conc} | " + " | ".join(cell(a_s, b_s) for a_s, b_s in counted) + " | " +
              " | ".join(cell(*itl(key), digits=0) for key in ["p50", "p99"]) +
              f" | {sim_cached * 100:.1f} % / {cached * 100:.1f} % | {preempted} |")
print(f"\nWithin 20 %: {within} of {total} medians (TTFT p50 and mean, ITL mean, out tok/s).")
EOF
