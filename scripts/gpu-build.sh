#!/usr/bin/env bash
# Builds, on any machine (no GPU or CUDA needed), what the GPU scripts run, into gpu-bin/ (ignored by
# git; the folder to carry to a GPU machine): the release `kura`, the GPU test binary, the GPU benchmark,
# the kernels precompiled for sm_90 and sm_80 in a kernel cache (NVRTC from PyPI), and the default
# model's tokenizer. Then, on the GPU machine: scripts/test-gpu.sh and bench/gpu.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
out=gpu-bin
mkdir -p "$out/cache" "$out/tokenizer"
set -a
eval "$(scripts/fetch-nvrtc.sh)"
set +a
cargo build --release -p kura -p kura-cuda --examples --bins >&2
test_bin=$(cargo test --release -p kura-cuda --test gpu --no-run --message-format=json 2>/dev/null \
  | python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "gpu":
        print(m["executable"])')
cp target/release/kura "$out/kura"
cp "$test_bin" "$out/kura-cuda-gpu-tests"
cp target/release/examples/gpu-bench "$out/gpu-bench"
strip "$out/kura" "$out/kura-cuda-gpu-tests" "$out/gpu-bench"
# Only this source's cubins: those of earlier versions of the kernels would travel too (2-3 MB a
# version, against the 64 MiB a device call carries).
rm -rf "$out/cache/cuda-kernels"
KURA_CACHE_DIR="$PWD/$out/cache" target/release/examples/kernel-cache sm_90 sm_80 >&2
scripts/gpu/tokenizer.sh "$out/tokenizer" >&2
du -sh "$out" >&2
