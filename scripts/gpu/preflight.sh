#!/usr/bin/env bash
# A device session's whole call (scripts/gpu/all.sh) on this machine's CPU, to run before a session on a
# lent GPU: the stand-in NVIDIA driver, cuBLAS and nvidia-smi of crates/kura-cuda/emu take the GPU's place,
# and KURA_GPU_PREFLIGHT=1 makes every step small enough to end in minutes (models of 2 layers, the
# Llama-3.1-8B-shaped one narrowed to hidden 1024 with heads of 128; gpu-bench at a 32nd of its lengths;
# hf_peer.py --small; a smaller shared-prefix run). Every script, test and benchmark section runs as it
# will on the device, through the release binaries that travel (scripts/gpu-build.sh). What it checks is
# the harness and the host code; its timings mean nothing, and the GPU's arithmetic, timing and
# concurrency are the device's to check. Three GPU tests are left out, named in the summary: the fused
# decode's (a sequence of 4,200 tokens), the wide prefill's and the greedy paths' run past 10 minutes each
# on the stand-in; tests/emulated_executor.rs runs their decode paths and kernels in CI. Nor is
# scripts/gpu/tiers.sh run (its model and loads are sized for a device). The servers and commands start
# with KURA_GPU_KERNELS=default: the timing of every kernel form over a 4,096-token prompt that a GPU does
# in about a second at each start takes the stand-in minutes (the GPU test of that timing runs, over 256
# tokens; tests/python/test_emulated_gpu.py runs a command's in CI), and the server check's requests get
# 600 s each (KURA_GPU_REQUEST_TIMEOUT_S; 60 on a device).
# Needs cargo, a C++ compiler (scripts/fetch-cxx.sh), NVRTC (scripts/fetch-nvrtc.sh) and PyPI: torch,
# transformers, httpx and the openai client go into a virtual environment under the cache (a few GB on
# first use). About 15-30 minutes on 2 cores (16 on a quiet one); exits as all.sh does (non-zero when a test or bench step failed).
# Usage: scripts/gpu/preflight.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/lib/fetch.sh
out=${1:-$(mktemp -d)}
mkdir -p "$out"
work=$(mktemp -d)
set -a
eval "$(scripts/fetch-nvrtc.sh)"
eval "$(scripts/fetch-cxx.sh)"
set +a
# The Python packages as the lent machine has them (transformers as its image holds it, the openai client
# as scripts/gpu/fetch-wheels.sh carries it, httpx from its image).
venv="$(kura_cache_root)/venv-gpu-preflight"
want="transformers==5.17.0 openai==2.54.0"
if [ "$("$venv/bin/python" -c 'import torch, httpx, transformers as t, openai as o
print(f"transformers=={t.__version__} openai=={o.__version__}")' 2>/dev/null)" != "$want" ]; then
  echo "== torch, $want and httpx into $venv" >&2
  python3 -m venv "$venv"
  # shellcheck disable=SC2086
  "$venv/bin/pip" install -q torch $want httpx
fi
echo "== scripts/gpu-build.sh" >&2
scripts/gpu-build.sh
echo "== the stand-in driver and cuBLAS" >&2
crates/kura-cuda/emu/build.sh "$work/emu"
cp crates/kura-cuda/emu/nvidia-smi "$work/emu/"
echo "== scripts/gpu/all.sh $out on the stand-in (models in $work/models)" >&2
PATH="$work/emu:$venv/bin:$PATH" LD_LIBRARY_PATH="$work/emu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
  KURA_GPU_PREFLIGHT=1 KURA_GPU_WORK="$work/models" KURA_GPU_BENCH_CONFIG="$work/models/llama8b4/config.json" \
  KURA_BENCH_LIMIT_S=1500 KURA_HF_LIMIT_S=300 KURA_CALIBRATE_LIMIT_S=900 KURA_GPU_KERNELS=default \
  KURA_GPU_REQUEST_TIMEOUT_S=600 \
  KURA_GPU_TESTS_LEFT_OUT="the_fused_decode_kernels_give_the_same_bits_as_the_separate_ones \
the_half_tile_and_small_prefill_kernels_give_the_narrow_and_the_wide_kernels_bits \
greedy_tokens_are_the_same_cold_cached_chunked_batched_and_for_every_block_size" \
  scripts/gpu/all.sh "$out" 3600 3000
