#!/usr/bin/env bash
# KV-aware routing against round-robin and least-load on a local fleet of the default model
# (bench/fleet.py says what is measured): shared-prefix and multi-turn workloads through `kura router`.
#
#   bench/fleet.sh                       (REPLICAS=2 THREADS=1 KV=64MiB POLICIES=kv,round-robin,least-load)
#   bench/fleet.sh --out docs/bench/fleet
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/.." && pwd)
KURA=${KURA_BIN:-$REPO/target/release/kura}
if [ -z "${KURA_BIN:-}" ]; then
  (cd "$REPO" && cargo build --release -p kura >&2)
fi
MODEL=${KURA_MODEL:-$("$REPO/scripts/fetch-model.sh")}
exec python3 "$HERE/fleet.py" --kura "$KURA" --model "$MODEL" --replicas "${REPLICAS:-2}" \
  --threads "${THREADS:-1}" --kv-cache-memory "${KV:-64MiB}" --policies "${POLICIES:-kv,round-robin,least-load}" "$@"
