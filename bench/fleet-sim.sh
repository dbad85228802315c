#!/usr/bin/env bash
# The fleet simulated on the Mooncake conversation trace: hit ratio, TTFT and throughput per routing
# policy for 4 to 64 replicas, the infinite-cache end, and the shared tier a fleet needs
# (bench/fleet-sim.py says what each part is). Deterministic: no model runs, only the cost model.
#
#   bench/fleet-sim.sh --out docs/bench/fleet-sim
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/.." && pwd)
KURA=${KURA_BIN:-$REPO/target/release/kura}
if [ -z "${KURA_BIN:-}" ]; then
  (cd "$REPO" && cargo build --release -p kura >&2)
fi
exec python3 "$HERE/fleet-sim.py" --kura "$KURA" "$@"
