#!/usr/bin/env bash
# Writes the default model's tokenizer and chat template as HF files (tokenizer.json,
# tokenizer_config.json) into DIR: what the models made on a GPU machine are given (the GGUF itself does
# not travel there). Usage: scripts/gpu/tokenizer.sh DIR (after cargo build --release -p kura-cuda --examples).
set -euo pipefail
cd "$(dirname "$0")/../.."
target/release/examples/export-tokenizer "$(scripts/fetch-model.sh)" "$1"
