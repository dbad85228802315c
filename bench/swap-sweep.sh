#!/usr/bin/env bash
# The cliff past the KV pool's knee, swap against recompute in one run: the `unique` workload swept over
# concurrency against two `kura serve`s that differ only in --preemption-mode, one after the other, then
# overlaid (compare.md and plots). `recompute` runs without a host tier (what preemption cost before the
# tiers), `swap` with one. Requests are admitted on their prompt's blocks, so preemption comes
# from requests that outgrow the pool while they decode: short prompts, long outputs, a small pool.
#
#   bench/swap-sweep.sh     (THREADS=2 POOL=32MiB HOST=1GiB SWEEP=1,2,4,8 REQUESTS=8 PROMPT=256
#                            OUTPUT=512 BATCH=512 OUT=bench-out/swap-sweep KURA_BIN=...
#                            DEVICE=cpu|cuda[:N] MODEL=<model dir or file; default: the default model>)
#
# On a GPU (swap then moves blocks over PCIe, into pinned host memory), e.g. with the GPU tests'
# Llama-3.1-8B-shaped model of 4 layers (scripts/gpu/make_models.py):
#   DEVICE=cuda MODEL=$work/llama8b4 POOL=256MiB HOST=8GiB SWEEP=4,8,16,32,64 REQUESTS=64 \
#     PROMPT=1024 OUTPUT=1024 BATCH=8192 KURA_BIN=gpu-bin/kura bench/swap-sweep.sh
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/.." && pwd)
THREADS=${THREADS:-2}
PORT=${PORT:-8013}
POOL=${POOL:-32MiB}
HOST=${HOST:-1GiB}
SWEEP=${SWEEP:-1,2,4,8}
REQUESTS=${REQUESTS:-8}
PROMPT=${PROMPT:-256}
OUTPUT=${OUTPUT:-512}
BATCH=${BATCH:-512}
OUT=${OUT:-$REPO/bench-out/swap-sweep}
KURA=${KURA_BIN:-$REPO/target/release/kura}
DEVICE=${DEVICE:-cpu}
model_args=()
[ -n "${MODEL:-}" ] && model_args=(--model "$MODEL")
if [ -z "${KURA_BIN:-}" ]; then
  (cd "$REPO" && cargo build --release -p kura >&2)
fi
URL="http://127.0.0.1:$PORT"
mkdir -p "$OUT"
for mode in recompute swap; do
  LOG="$OUT/serve-$mode.log"
  # recompute: the server without a host tier (evicted blocks of a preempted request are gone);
  # swap: the same server with one (preempted requests' blocks are copied there and loaded back).
  host=0
  [ "$mode" = swap ] && host=$HOST
  "$KURA" serve "${model_args[@]}" --device "$DEVICE" --host 127.0.0.1 --port "$PORT" --threads "$THREADS" \
    --kv-cache-memory "$POOL" \
    --kv-host-memory "$host" --preemption-mode "$mode" --max-num-batched-tokens "$BATCH" >"$LOG" 2>&1 &
  PID=$!
  trap 'kill $PID 2>/dev/null || true' EXIT
  for _ in $(seq 1 600); do
    curl -fsS -m 2 "$URL/health" >/dev/null 2>&1 && break
    kill -0 "$PID" 2>/dev/null || { cat "$LOG" >&2; exit 1; }
    sleep 0.5
  done
  echo "== $mode on $DEVICE (load $(cut -d' ' -f1 /proc/loadavg))" >&2
  "$KURA" bench unique --url "$URL" --requests "$REQUESTS" --sweep-concurrency "$SWEEP" \
    --prompt-tokens "$PROMPT" --output-tokens "$OUTPUT" \
    --label "preemption $mode" --out "$OUT/$mode" >&2
  curl -fsS "$URL/metrics" | grep -E '^kura:(num_preemptions_total|kv_swapped_out_blocks_total|prompt_tokens_computed_total|kv_tier_hit_blocks_total|kv_cache_evictions_total|kv_evictions_copied_total|kv_host_stored_ahead_blocks_total)' \
    >"$OUT/metrics-$mode.txt"
  kill -INT "$PID"
  wait "$PID" || true
done
trap - EXIT
"$KURA" bench --compare "$OUT/recompute/run.json" "$OUT/swap/run.json" --out "$OUT/compare"
cat "$OUT"/metrics-*.txt
