#!/usr/bin/env bash
# One device session's GPU work in one call: scripts/test-gpu.sh, then bench/gpu.sh (with the
# shared-prefix run against `kura serve --device cuda` on the test's SmolLM2-shaped model), each under a
# time limit, their logs and results under OUT_DIR, and a summary printed last and kept in
# OUT_DIR/summary.txt (the test verdicts, the logits comparisons, the pool check, why a step failed and
# the figures table; the tests' part is written there as soon as they end, so that a limit that cuts the
# benchmarks keeps it). A failing or timed-out test step does not stop the benchmarks. Exits non-zero
# when either step failed. KURA_GPU_SUMMARY_COPY: a file the summary is also copied to as each part is
# written (scripts/gpu/session.sh: one that comes back from the device machine even if the call is cut).
# Usage, on the GPU machine with gpu-bin/ (scripts/gpu-build.sh) and .whl/ (scripts/gpu/fetch-wheels.sh) carried:
#   scripts/gpu/all.sh OUT_DIR [TEST_LIMIT_S=240] [BENCH_LIMIT_S=300]
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
out=${1:?usage: scripts/gpu/all.sh OUT_DIR [TEST_LIMIT_S] [BENCH_LIMIT_S]}
test_limit=${2:-240}
bench_limit=${3:-300}
mkdir -p "$out/bench"
# The models the tests make stay here for a second call on the same machine (scripts/gpu/tiers.sh).
work=${KURA_GPU_WORK:-/tmp/kura-gpu-work}
mkdir -p "$work"
# A driver that does not answer must not hold the session: 30 s at most.
timeout -k 5 30 nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv,noheader
# Each step in a process group of its own under its limit (scripts/gpu/bounded.sh): the TERM at the
# limit goes to the whole group, and whatever of the group outlasts the step (a server) is ended after
# it, killed 5 s later, before the next step starts; at most 10 s past the limit in all.
source scripts/gpu/bounded.sh
bounded "$test_limit" bash scripts/test-gpu.sh "$work" >"$out/test.log" 2>&1
test_rc=$?
{
  echo "== scripts/test-gpu.sh: exit $test_rc (124: over ${test_limit} s)"
  grep -E '^test |test result|FAIL|panicked|within|against float32|fp8 KV|^pool:|^server:|host tier:|cached_tokens on|reference exact|ordered loads of|warpgroup products|kernel-timing server|kura generate --device|== ' \
    "$out/test.log" | tail -70
  if [ "$test_rc" -ne 0 ]; then
    echo "-- why (each panic's message, then the log's last lines):"
    grep -A4 'panicked at' "$out/test.log" | head -60
    tail -12 "$out/test.log"
  fi
} >"$out/summary.txt"
[ -z "${KURA_GPU_SUMMARY_COPY:-}" ] || cp "$out/summary.txt" "$KURA_GPU_SUMMARY_COPY"
# The benchmarks' steps share their limit (KURA_BENCH_BUDGET_S), less 5 s for bench/gpu.sh's own end.
bounded "$bench_limit" env KURA_GPU_SERVE_MODEL="$work/smol" \
  KURA_BENCH_BUDGET_S=$((bench_limit > 10 ? bench_limit - 5 : bench_limit)) \
  bash bench/gpu.sh "$out/bench" >"$out/bench.log" 2>&1
bench_rc=$?
# Plots are pictures, and a folder too deep to come back from the device machine: keep the files that do.
rm -rf "$out/bench/shared-prefix/plots"
{
  echo "== bench/gpu.sh: exit $bench_rc (124: over ${bench_limit} s)"
  # Without the JSON lines (in bench/kura.jsonl and bench/hf.jsonl): the tables, the sections gpu-bench
  # skipped or lost, errors and the served runs.
  grep -v '^[{[]' "$out/bench.log" | tail -150
} >>"$out/summary.txt"
[ -z "${KURA_GPU_SUMMARY_COPY:-}" ] || cp "$out/summary.txt" "$KURA_GPU_SUMMARY_COPY"
cat "$out/summary.txt"
exit $((test_rc | bench_rc))
