#!/usr/bin/env bash
# Starts `kura serve` on the default model (SmolLM2-135M-Instruct), fetching and verifying it on first use.
# Extra arguments go to `kura serve` (e.g. --port 8000 --kv-cache-memory 512MiB).
set -euo pipefail
cd "$(dirname "$0")/.."
model=$(scripts/fetch-model.sh)
cargo build --release -q -p kura
exec target/release/kura serve --model "$model" "$@"
