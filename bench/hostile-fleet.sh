#!/usr/bin/env bash
# A hostile probe of a local fleet (Redis, two replicas with two tenant keys and an operator key, the
# router): see bench/hostile-fleet.py. Writes docs/bench/hostile-fleet/results.md (and .json).
#   bench/hostile-fleet.sh            # release build; KURA_BIN picks another binary
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
if [ -z "${KURA_BIN:-}" ]; then
  (cd "$REPO" && cargo build --release -p kura >&2)
  KURA_BIN="$REPO/target/release/kura"
fi
MODEL=${KURA_MODEL:-$("$REPO/scripts/fetch-model.sh")}
REDIS_SERVER=$("$REPO/scripts/fetch-redis.sh")
VENV=${KURA_VENV:-$HOME/.cache/kura/venv-test}
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet -r "$REPO/tests/python/requirements.txt"
fi
exec "$VENV/bin/python" "$REPO/bench/hostile-fleet.py" --kura "$KURA_BIN" --model "$MODEL" \
  --redis-server "$REDIS_SERVER" --out "${OUT:-$REPO/docs/bench/hostile-fleet}" "$@"
