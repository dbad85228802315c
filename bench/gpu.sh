#!/usr/bin/env bash
# Kura's GPU benchmarks beside HF transformers on the same GPU, Llama-3.1-8B's shape with random bf16
# weights (bench/gpu/llama-3.1-8b.json): batch-1 decode after 1,024 tokens (and its share of the HBM
# bound), prefill TTFT at 4,096 and 16,384 tokens, decode at batch 64 with 1,024 tokens of context, and
# the TTFT of a 4,096-token prompt with 4,080 cached. Needs gpu-bin/ (scripts/gpu-build.sh).
# Writes the JSON lines of both to OUT_DIR (default: a temporary folder) and prints a table.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu/env.sh
export KURA_CACHE_DIR="$PWD/gpu-bin/cache"
out=${1:-$(mktemp -d)}
mkdir -p "$out"
gpu-bin/gpu-bench bench/gpu/llama-3.1-8b.json | tee "$out/kura.jsonl"
python3 bench/gpu/hf_peer.py | tee "$out/hf.jsonl"
python3 bench/gpu/table.py "$out/kura.jsonl" "$out/hf.jsonl"
