#!/usr/bin/env bash
# Starts a local fleet on the default model: REPLICAS `kura serve --kv-events` replicas (ports PORT+1 …),
# `kura router` over them on PORT, and with REDIS=1 a `redis-server` (scripts/fetch-redis.sh) on
# PORT+100 that every replica uses as its shared KV tier (--kv-redis-url). Runs until Ctrl-C or SIGTERM,
# then stops everything it started. Logs go to $LOGS (default: a temporary directory, printed), beside
# the fleet's secret (fleet.secret) and the replicas' operator key (admin.key), both made there (mode 600)
# unless present, and given as files to every replica and to the router.
#
#   scripts/fleet.sh                                   2 replicas, policy kv, router on 127.0.0.1:8000
#   REPLICAS=4 POLICY=round-robin THREADS=1 REDIS=1 scripts/fleet.sh -- --kv-cache-memory 64MiB
#
# Arguments after `--` go to every `kura serve`. KURA_BIN picks the binary (default: a release build).
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
REPLICAS=${REPLICAS:-2}
PORT=${PORT:-8000}
POLICY=${POLICY:-kv}
THREADS=${THREADS:-1}
REDIS=${REDIS:-0}
HOST=${HOST:-127.0.0.1}
if [ "${1:-}" = "--" ]; then shift; fi
if [ -z "${KURA_BIN:-}" ]; then
  (cd "$REPO" && cargo build --release -p kura >&2)
  KURA_BIN="$REPO/target/release/kura"
fi
MODEL=${KURA_MODEL:-$("$REPO/scripts/fetch-model.sh")}
LOGS=${LOGS:-$(mktemp -d -t kura-fleet-XXXXXX)}
mkdir -p "$LOGS"
# A random hex secret of 32 bytes in file $1, readable by this user only, unless the file exists.
make_secret() {
  [ -s "$1" ] && return 0
  (
    umask 077
    if command -v openssl >/dev/null 2>&1; then
      openssl rand -hex 32 >"$1"
    else
      od -An -tx1 -N32 /dev/urandom | tr -d ' \n' >"$1" && echo >>"$1"
    fi
  )
  chmod 600 "$1"
}
SECRET_FILE="$LOGS/fleet.secret"
ADMIN_FILE="$LOGS/admin.key"
make_secret "$SECRET_FILE"
make_secret "$ADMIN_FILE"
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
}
trap cleanup EXIT INT TERM

wait_http() {
  for _ in $(seq 1 600); do
    if curl -sf "$1" >/dev/null 2>&1; then return 0; fi
    sleep 0.2
  done
  echo "fleet.sh: $1 did not answer; logs in $LOGS" >&2
  exit 1
}

redis_args=()
if [ "$REDIS" = 1 ]; then
  REDIS_SERVER=$("$REPO/scripts/fetch-redis.sh")
  redis_port=$((PORT + 100))
  "$REDIS_SERVER" --port "$redis_port" --bind 127.0.0.1 --save "" --appendonly no --dir "$LOGS" \
    >"$LOGS/redis.log" 2>&1 &
  pids+=($!)
  redis_args=(--kv-redis-url "redis://127.0.0.1:$redis_port")
  echo "redis    redis://127.0.0.1:$redis_port" >&2
fi

router_args=()
for i in $(seq 1 "$REPLICAS"); do
  p=$((PORT + i))
  "$KURA_BIN" serve --model "$MODEL" --host "$HOST" --port "$p" --threads "$THREADS" --kv-events \
    --fleet-secret-file "$SECRET_FILE" --admin-api-key-file "$ADMIN_FILE" \
    "${redis_args[@]}" "$@" >"$LOGS/replica-$i.log" 2>&1 &
  pids+=($!)
  router_args+=(--replica "http://$HOST:$p")
done
for i in $(seq 1 "$REPLICAS"); do
  wait_http "http://$HOST:$((PORT + i))/health"
  echo "replica  http://$HOST:$((PORT + i))" >&2
done
"$KURA_BIN" router --model "$MODEL" --host "$HOST" --port "$PORT" --policy "$POLICY" "${router_args[@]}" \
  --fleet-secret-file "$SECRET_FILE" --replica-admin-key-file "$ADMIN_FILE" >"$LOGS/router.log" 2>&1 &
pids+=($!)
wait_http "http://$HOST:$PORT/health"
echo "router   http://$HOST:$PORT/v1  (policy $POLICY; logs in $LOGS)" >&2
wait -n "${pids[@]}"
echo "fleet.sh: a process of the fleet exited; stopping the rest (logs in $LOGS)" >&2
exit 1
