#!/usr/bin/env bash
# A lent GPU machine's whole session in one call that ends within the device tool's command limit:
# scripts/gpu/all.sh (the GPU tests, then bench/gpu.sh), then scripts/gpu/tiers.sh (the host tier through
# `kura serve --device cuda`) in what is left before DEADLINE_S,
# then Kura's CPU decode across thread counts on the machine's cores (bench/device/kura-threads.sh) in what
# is left, then a file set that comes back whole: at most 7 files, none deeper than two folders
# (OUT_DIR/all-summary.txt, tiers-summary.txt, threads.md, the benchmark's JSON lines and one archive of
# every log). Each step's summary and results are copied to OUT_DIR as soon as the step returns (the
# tests' summary as soon as the tests end), so that a call cut short still brings back what was done.
# The summaries are printed last.
# Usage, on the GPU machine with gpu-bin/ (or device-pack/) and .whl/ carried (scripts/gpu-build.sh,
# scripts/gpu/pack.sh, scripts/gpu/fetch-wheels.sh): DEADLINE_S=<the call's limit less 25> scripts/gpu/session.sh OUT_DIR
# Environment: DEADLINE_S [570, for a call of 595 s] seconds from the start by which everything has ended;
#   TEST_LIMIT_S [220] and BENCH_LIMIT_S [250] for all.sh's two steps, both cut in proportion where
#   DEADLINE_S leaves all.sh less than their sum (DEADLINE_S less 50 s); TIERS_MIN_S [100] the least time
#   tiers.sh is started with.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
out=${1:?usage: scripts/gpu/session.sh OUT_DIR}
deadline=${DEADLINE_S:-570}
test_limit=${TEST_LIMIT_S:-220}
bench_limit=${BENCH_LIMIT_S:-250}
tiers_min=${TIERS_MIN_S:-100}
for v in "$deadline" "$test_limit" "$bench_limit" "$tiers_min"; do
  case "$v" in '' | *[!0-9]* | 0) echo "session.sh: limits are whole seconds above 0, got '$v'" >&2; exit 2 ;; esac
done
start=$(date +%s)
# all.sh's outer limit is its two steps' plus 30 s; 20 s more are kept for the packing at the end.
room=$((deadline - 50))
if [ "$room" -lt 60 ]; then
  echo "session.sh: DEADLINE_S=$deadline leaves all.sh ${room} s, too few for the tests and benchmarks" >&2
  exit 2
fi
if [ $((test_limit + bench_limit)) -gt "$room" ]; then
  cut_test=$((room * test_limit / (test_limit + bench_limit)))
  echo "session.sh: DEADLINE_S=$deadline leaves all.sh $room s: tests $cut_test s (of $test_limit), benchmarks $((room - cut_test)) s (of $bench_limit)"
  test_limit=$cut_test
  bench_limit=$((room - cut_test))
fi
mkdir -p "$out/all" "$out/tiers"
source scripts/gpu/bounded.sh
# gpu-bin/ may have travelled packed (scripts/gpu/pack.sh: device-pack/, 10 MB in place of 42).
bash scripts/gpu/unpack.sh || exit 1
# Each step also under a limit of its own from outside, in a process group of its own that is ended
# whole after it (scripts/gpu/bounded.sh: at most 10 s past the limit), so that nothing it leaves
# hanging (a model made again, a server) outlasts the deadline and the packing below.
bounded $((test_limit + bench_limit + 30)) env KURA_GPU_SUMMARY_COPY="$out/all-summary.txt" \
  bash scripts/gpu/all.sh "$out/all" "$test_limit" "$bench_limit" >"$out/all.log" 2>&1
all_rc=$?
# all.sh's results up to OUT_DIR at once (its summary is there already where it wrote one).
[ -f "$out/all-summary.txt" ] || echo "all.sh wrote no summary (exit $all_rc)" >"$out/all-summary.txt"
for f in kura.jsonl hf.jsonl; do
  [ -f "$out/all/bench/$f" ] && cp "$out/all/bench/$f" "$out/$f"
done
left=$((deadline - ($(date +%s) - start) - 15))
tiers_rc=0
# tiers.sh gives each of its two steps half its limit: at most 200 s in all, and 45 s kept for the thread
# counts below where that still leaves it TIERS_MIN_S.
tiers_limit=$((left - 45 >= tiers_min ? left - 45 : left))
[ "$tiers_limit" -le 200 ] || tiers_limit=200
if [ "$left" -ge "$tiers_min" ]; then
  bounded $((tiers_limit + 10)) bash scripts/gpu/tiers.sh "$out/tiers" "$tiers_limit" >"$out/tiers.log" 2>&1
  tiers_rc=$?
  cp "$out/tiers/summary.txt" "$out/tiers-summary.txt" 2>/dev/null \
    || echo "tiers.sh wrote no summary (exit $tiers_rc)" >"$out/tiers-summary.txt"
  [ -f "$out/tiers/hostconvoy.json" ] && cp "$out/tiers/hostconvoy.json" "$out/hostconvoy.json"
else
  echo "tiers.sh not run: ${left} s left before the ${deadline} s deadline" | tee "$out/tiers-summary.txt"
  tiers_rc=1
fi
# Kura's CPU decode across thread counts on this machine's cores, in what is left (the GPU is idle by now).
# kura-threads.sh starts runs until its DEADLINE_S and stops one still going 20 s past it (5 s more for
# the KILL), then prints its table: 35 s before the outer limit leave the table 10 s.
left=$((deadline - ($(date +%s) - start) - 10))
work=${KURA_GPU_WORK:-/tmp/kura-gpu-work}
if [ "$left" -ge 45 ] && [ -f "$work/smol/config.json" ]; then
  bounded "$left" env DEADLINE_S=$((left - 35)) bash bench/device/kura-threads.sh gpu-bin/kura "$work/smol" "$out/tiers/threads.jsonl" \
    >"$out/threads.md" 2>&1 || echo "bench/device/kura-threads.sh failed" >>"$out/threads.md"
else
  echo "bench/device/kura-threads.sh not run: ${left} s left, or no model at $work/smol" >"$out/threads.md"
fi
logs=()
for p in all tiers all.log tiers.log; do [ -e "$out/$p" ] && logs+=("$p"); done
(cd "$out" && tar czf logs.tgz "${logs[@]}" --remove-files) || echo "packing the logs failed" >&2
# A file over 16 MiB does not come back from the device machine.
echo "logs.tgz: $(du -b "$out/logs.tgz" 2>/dev/null | cut -f1) bytes (at most 16 MiB come back)"
echo "== session: all.sh exit $all_rc, tiers.sh exit $tiers_rc, $(($(date +%s) - start)) s"
cat "$out/all-summary.txt" "$out/tiers-summary.txt" "$out/threads.md"
exit $((all_rc | tiers_rc))
