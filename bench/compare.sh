#!/usr/bin/env bash
# One command for the comparison: the same seeded workloads against
#   kura          (target/release/kura serve, prefix caching on)
#   kura-nocache  (kura serve --no-prefix-cache)
#   llama.cpp     (llama-server from bench/peers/, prompt caching on)
# all on the same model file, one server at a time on loopback ports, then overlaid reports:
#   $OUT/<workload>/<server>/{run.json,summary.md,plots/}   each run
#   $OUT/<workload>/{compare.md,plots/}                     the servers side by side
#   $OUT/README.md                                          every table in one page
#
# Usage: bench/compare.sh [OUT]        (default OUT: ~/.cache/kura/bench/<UTC date-time>)
# Environment (defaults in brackets):
#   SERVERS ["kura kura-nocache llama.cpp"]  WORKLOADS ["shared-prefix multi-turn unique"]
#   MODEL [scripts/fetch-model.sh]  THREADS [all cores]  CONCURRENCY [8]  OUTPUT_TOKENS [64]  SEED [0]
#   PREFIX_GROUPS [4] USERS_PER_GROUP [8] SYSTEM_TOKENS [1000] QUESTION_TOKENS [50]     shared-prefix
#   CONVERSATIONS [8] TURNS [4]                                                  multi-turn
#   UNIQUE_REQUESTS [32] UNIQUE_TOKENS [1050]                                    unique
#   KURA_PORT [8000] LLAMA_PORT [8090] KURA_ARGS [] (extra `kura serve` flags)
#   KURA_BIN [] a kura binary to use instead of building target/release/kura
#   LLAMA_THREADS [THREADS] (llama.cpp's spinning thread barriers suffer badly on a busy machine: 1 helps)
#   SWEEP ["" or e.g. "1,2,4,8,12,16,24"]: also a concurrency sweep of `unique` (SWEEP_REQUESTS [24]
#   requests of UNIQUE_TOKENS) on a kura server with a small KV pool (SWEEP_KV [512MiB], f32), with the
#   max concurrency `kura plan` predicts for that pool marked on the plots.
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/.." && pwd)
OUT="${1:-${KURA_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/kura}/bench/$(date -u +%Y%m%d-%H%M%S)}"
SERVERS="${SERVERS:-kura kura-nocache llama.cpp}"
WORKLOADS="${WORKLOADS:-shared-prefix multi-turn unique}"
THREADS="${THREADS:-$(nproc)}"
CONCURRENCY="${CONCURRENCY:-8}"
OUTPUT_TOKENS="${OUTPUT_TOKENS:-64}"
SEED="${SEED:-0}"
KURA_PORT="${KURA_PORT:-8000}"
LLAMA_PORT="${LLAMA_PORT:-8090}"
MODEL="${MODEL:-$("$REPO/scripts/fetch-model.sh")}"
KURA="$REPO/target/release/kura"

mkdir -p "$OUT"
echo "compare: model $MODEL, results in $OUT" >&2
if [ -z "${KURA_BIN:-}" ]; then
  echo "compare: building target/release/kura" >&2
  if ! (cd "$REPO" && cargo build --release -p kura >&2); then
    [ -x "$KURA" ] || exit 1
    echo "compare: the build failed; using the existing $KURA" >&2
  fi
else
  KURA="$KURA_BIN"
fi

SERVER_PID=""
stop_server() {
  if [ -n "$SERVER_PID" ] && kill -0 "$SERVER_PID" 2>/dev/null; then
    kill "$SERVER_PID"
    for _ in $(seq 100); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 0.1; done
  fi
  SERVER_PID=""
  PORT="$LLAMA_PORT" "$HERE/peers/llama-server.sh" stop 2>/dev/null || true
}
trap stop_server EXIT

wait_healthy() { # url pid log
  for _ in $(seq 600); do
    if curl -fsS -m 2 "$1/health" >/dev/null 2>&1; then return 0; fi
    if ! kill -0 "$2" 2>/dev/null; then
      echo "compare: the server exited during start-up; last lines of $3:" >&2
      tail -20 "$3" >&2
      return 1
    fi
    sleep 0.5
  done
  echo "compare: $1/health not ready after 300 s; see $3" >&2
  return 1
}

start_server() { # name; sets URL (and SERVER_PID for kura). Not in a subshell: stop_server needs the pid.
  case "$1" in
    kura | kura-nocache)
      if curl -fsS -m 2 "http://127.0.0.1:$KURA_PORT/health" >/dev/null 2>&1; then
        echo "compare: another server already answers on port $KURA_PORT; stop it or set KURA_PORT" >&2
        return 1
      fi
      local extra=""
      [ "$1" = kura-nocache ] && extra="--no-prefix-cache"
      # shellcheck disable=SC2086
      "$KURA" serve --model "$MODEL" --host 127.0.0.1 --port "$KURA_PORT" --threads "$THREADS" \
        $extra ${KURA_ARGS:-} >"$OUT/$1.log" 2>&1 &
      SERVER_PID=$!
      URL="http://127.0.0.1:$KURA_PORT"
      wait_healthy "$URL" "$SERVER_PID" "$OUT/$1.log" || return 1
      ;;
    llama.cpp)
      URL=$(PORT="$LLAMA_PORT" THREADS="${LLAMA_THREADS:-$THREADS}" MODEL="$MODEL" "$HERE/peers/llama-server.sh")
      ;;
    *) echo "compare: unknown server $1 (kura, kura-nocache, llama.cpp)" >&2; return 1 ;;
  esac
}

workload_args() {
  case "$1" in
    shared-prefix)
      echo "--groups ${PREFIX_GROUPS:-4} --users-per-group ${USERS_PER_GROUP:-8} --system-tokens ${SYSTEM_TOKENS:-1000} --question-tokens ${QUESTION_TOKENS:-50}" ;;
    multi-turn) echo "--conversations ${CONVERSATIONS:-8} --turns ${TURNS:-4}" ;;
    unique) echo "--requests ${UNIQUE_REQUESTS:-32} --prompt-tokens ${UNIQUE_TOKENS:-1050}" ;;
    long-doc) echo "" ;;
    *) echo "compare: unknown workload $1" >&2; return 1 ;;
  esac
}

for server in $SERVERS; do
  start_server "$server"
  url="$URL"
  echo "compare: $server at $url" >&2
  for wl in $WORKLOADS; do
    # shellcheck disable=SC2046
    "$KURA" bench "$wl" $(workload_args "$wl") --url "$url" --label "$server" --seed "$SEED" \
      --concurrency "$CONCURRENCY" --output-tokens "$OUTPUT_TOKENS" --out "$OUT/$wl/$server" ||
      echo "compare: $wl on $server reported failures (see $OUT/$wl/$server)" >&2
  done
  stop_server
done

if [ -n "${SWEEP:-}" ]; then
  SWEEP_KV="${SWEEP_KV:-512MiB}"
  context=$(( ${UNIQUE_TOKENS:-1050} + OUTPUT_TOKENS + 32 ))
  mark=$("$KURA" plan --model "$MODEL" --context "$context" --kv-dtype f32 --kv-cache-memory "$SWEEP_KV" --json |
    python3 -c 'import json,sys; print(json.load(sys.stdin)["max_concurrency"])')
  echo "compare: sweep on kura with a $SWEEP_KV KV pool; kura plan predicts $mark requests of $context tokens" >&2
  KURA_ARGS="${KURA_ARGS:-} --kv-cache-memory $SWEEP_KV --kv-dtype f32"
  start_server kura
  url="$URL"
  "$KURA" bench unique --requests "${SWEEP_REQUESTS:-24}" --prompt-tokens "${UNIQUE_TOKENS:-1050}" --url "$url" \
    --label "kura ($SWEEP_KV KV)" --seed "$SEED" --sweep-concurrency "$SWEEP" --output-tokens "$OUTPUT_TOKENS" \
    --out "$OUT/sweep/kura" --mark-concurrency "$mark" --mark-label "KV pool (kura plan)" ||
    echo "compare: the sweep reported failures" >&2
  stop_server
fi

{
  echo "# Kura comparison"
  echo
  echo "Model: \`$(basename "$MODEL")\`; $THREADS threads; concurrency $CONCURRENCY; $OUTPUT_TOKENS output tokens; seed $SEED;"
  echo "machine: $(nproc) cores, load average at the end: $(cut -d' ' -f1-3 /proc/loadavg)."
  echo
} >"$OUT/README.md"
for wl in $WORKLOADS; do
  runs=()
  for server in $SERVERS; do
    [ -f "$OUT/$wl/$server/run.json" ] && runs+=("$OUT/$wl/$server/run.json")
  done
  [ ${#runs[@]} -eq 0 ] && continue
  "$KURA" bench --compare "${runs[@]}" --out "$OUT/$wl" >/dev/null
  { echo "## $wl"; echo; sed -n '/^| run/,/^$/p' "$OUT/$wl/compare.md"; echo "Plots: [$wl/plots]($wl/plots), details: [$wl/compare.md]($wl/compare.md)"; echo; } >>"$OUT/README.md"
done
if [ -f "$OUT/sweep/kura/summary.md" ]; then
  { echo "## concurrency sweep (kura, unique, small KV pool)"; echo; sed -n '/^| run/,/^$/p' "$OUT/sweep/kura/summary.md"; echo "Plots: [sweep/kura/plots](sweep/kura/plots)"; } >>"$OUT/README.md"
fi
echo "compare: report $OUT/README.md" >&2
cat "$OUT/README.md"
