#!/usr/bin/env bash
# Kura's GPU benchmarks beside HF transformers on the same GPU, Llama-3.1-8B's shape with random bf16
# weights (bench/gpu/llama-3.1-8b.json): batch-1 decode after 1,024 tokens (and its share of the HBM
# bound), prefill TTFT at 4,096 and 16,384 tokens, decode at batch 64 with 1,024 tokens of context, and
# the TTFT of a 4,096-token prompt with 4,080 cached. Needs gpu-bin/ (scripts/gpu-build.sh).
# Writes the JSON lines of both to OUT_DIR (default: a temporary folder) and prints a table. With
# KURA_GPU_SERVE_MODEL set to a model directory, also runs `kura bench shared-prefix` against
# `kura serve --device cuda` on that model.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu/env.sh
export KURA_CACHE_DIR="$PWD/gpu-bin/cache"
out=${1:-$(mktemp -d)}
mkdir -p "$out"
gpu-bin/gpu-bench bench/gpu/llama-3.1-8b.json | tee "$out/kura.jsonl"
python3 bench/gpu/hf_peer.py | tee "$out/hf.jsonl"
python3 bench/gpu/table.py "$out/kura.jsonl" "$out/hf.jsonl"
if [ -n "${KURA_GPU_SERVE_MODEL:-}" ]; then
  port=8391
  gpu-bin/kura serve --device cuda --model "$KURA_GPU_SERVE_MODEL" --port $port --kv-cache-memory 8GiB \
    > "$out/serve.log" 2>&1 &
  serve_pid=$!
  # The server goes with the script, however it ends.
  trap 'kill $serve_pid 2>/dev/null || true' EXIT
  for _ in $(seq 120); do
    kill -0 $serve_pid 2>/dev/null || { echo "kura serve --device cuda exited:" >&2; tail -20 "$out/serve.log" >&2; exit 1; }
    python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$port/health', timeout=1)" 2>/dev/null && break
    sleep 0.5
  done
  gpu-bin/kura bench shared-prefix --url "http://127.0.0.1:$port" --groups 4 --users-per-group 8 \
    --system-tokens 2000 --question-tokens 50 --output-tokens 32 --out "$out/shared-prefix" 2>&1 | tail -25
  kill $serve_pid
  wait $serve_pid 2>/dev/null || true
fi
