#!/usr/bin/env bash
# The lower KV tiers against recompute on the default model (bench/tiers.py says what each part measures):
# revisit TTFT from the host tier and from disk across prompt lengths, a working set several times the
# pool, a restart on the same --kv-disk-path, and 16 concurrent requests over a prefix only on disk.
#
#   bench/tiers.sh                      (THREADS=2 REPS=3 ONLY=revisit,workset,restart,convoy KURA_BIN=...)
#   bench/tiers.sh --json out.json      (extra arguments go to bench/tiers.py)
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/.." && pwd)
KURA=${KURA_BIN:-$REPO/target/release/kura}
if [ -z "${KURA_BIN:-}" ]; then
  (cd "$REPO" && cargo build --release -p kura >&2)
fi
MODEL=${KURA_MODEL:-$("$REPO/scripts/fetch-model.sh")}
exec python3 "$HERE/tiers.py" --kura "$KURA" --model "$MODEL" --threads "${THREADS:-2}" \
  --reps "${REPS:-3}" --only "${ONLY:-revisit,workset,restart,convoy}" "$@"
