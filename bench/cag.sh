#!/usr/bin/env bash
# Cache-augmented generation: a ~6,000-token document saved with Kura's POST /v1/caches, the server
# restarted on the same --kv-disk-path, then 8 questions with `cached_content`, each TTFT against the
# document sent cold; llama.cpp's slot save/restore of the same document measured in the same run
# (restore time plus first token). bench/cag.py says what each figure is.
#
#   bench/cag.sh                          THREADS=2 (comma-separated list, e.g. 2,1: one full run each)
#   THREADS=2,1 bench/cag.sh              REPS=3 cold requests per question, DOC_TOKENS=6000, MAX_TOKENS=16
#   NO_LLAMA=1 bench/cag.sh               Kura only
#
# Kura: $KURA_BIN, else target/release/kura (build it first: cargo build --release -p kura; this script
# builds nothing of Kura). llama.cpp: built (once, ~10-20 min) by bench/peers/build-llama-cpp.sh.
# Model: $KURA_MODEL, else scripts/fetch-model.sh. The report goes to $OUT, else
# docs/bench/cag/results-<date>.md (and $OUT's .json beside it); it is also printed.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/.." && pwd)
KURA=${KURA_BIN:-$REPO/target/release/kura}
[ -x "$KURA" ] || { echo "cag.sh: $KURA not found: cargo build --release -p kura, or set KURA_BIN" >&2; exit 1; }
MODEL=${KURA_MODEL:-$("$REPO/scripts/fetch-model.sh")}
PY=${PYTHON:-$HOME/.cache/kura/venv-test/bin/python}
[ -x "$PY" ] || PY=python3
"$PY" -c 'import httpx' 2>/dev/null || { echo "cag.sh: $PY lacks httpx (set PYTHON)" >&2; exit 1; }

LLAMA_ARGS=()
if [ -z "${NO_LLAMA:-}" ]; then
  LLAMA_BIN=$(JOBS="${JOBS:-2}" NICE="${NICE:-15}" "$HERE/peers/build-llama-cpp.sh")
  LLAMA_ARGS=(--llama-bin "$LLAMA_BIN")
fi

OUT=${OUT:-$REPO/docs/bench/cag/results-$(date +%F).md}
mkdir -p "$(dirname "$OUT")"
UPTIME=$(uptime)
echo "cag.sh: uptime before: $UPTIME" >&2
CMD="${CMD_LABEL:-THREADS=${THREADS:-2} REPS=${REPS:-3} bench/cag.sh}"
exec "$PY" "$HERE/cag.py" --kura "$KURA" --model "$MODEL" --threads "${THREADS:-2}" \
  --cold-reps "${REPS:-3}" --doc-tokens "${DOC_TOKENS:-6000}" --max-tokens "${MAX_TOKENS:-16}" \
  --out "$OUT" --json "${OUT%.md}.json" --uptime "$UPTIME" --command "$CMD" "${LLAMA_ARGS[@]}" "$@"
