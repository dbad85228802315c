#!/usr/bin/env bash
# One device session's GPU work in one call: scripts/test-gpu.sh, then bench/gpu.sh (with the
# shared-prefix run against `kura serve --device cuda` on the test's SmolLM2-shaped model), each under a
# time limit, their logs and results under OUT_DIR, and a summary printed last (the test verdicts, the
# logits comparisons, the pool check and the figures table).
# Usage, on the GPU machine with gpu-bin/ (scripts/gpu-build.sh) and .whl/ (scripts/gpu/fetch-wheels.sh) carried:
#   scripts/gpu/all.sh OUT_DIR [TEST_LIMIT_S=240] [BENCH_LIMIT_S=300]
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${1:?usage: scripts/gpu/all.sh OUT_DIR [TEST_LIMIT_S] [BENCH_LIMIT_S]}
test_limit=${2:-240}
bench_limit=${3:-300}
mkdir -p "$out/bench"
# The models the tests make stay here for a second call on the same machine (scripts/gpu/tiers.sh).
work=${KURA_GPU_WORK:-/tmp/kura-gpu-work}
mkdir -p "$work"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv,noheader
timeout "$test_limit" bash scripts/test-gpu.sh "$work" >"$out/test.log" 2>&1
test_rc=$?
KURA_GPU_SERVE_MODEL="$work/smol" timeout "$bench_limit" bash bench/gpu.sh "$out/bench" >"$out/bench.log" 2>&1
bench_rc=$?
echo "== scripts/test-gpu.sh: exit $test_rc (124: over ${test_limit} s)"
grep -E '^test |test result|FAILED|panicked|within|against float32|fp8 KV|^pool:|^server:|== ' "$out/test.log" | tail -60
echo "== bench/gpu.sh: exit $bench_rc (124: over ${bench_limit} s)"
tail -45 "$out/bench.log"
