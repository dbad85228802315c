#!/usr/bin/env bash
# The host tier of a GPU server through `kura serve --device cuda`, for a second call on the machine that
# scripts/gpu/all.sh just ran on (its models stay in $KURA_GPU_WORK, default /tmp/kura-gpu-work; made
# here if missing), on the Llama-3.1-8B-shaped model cut to 4 layers (random bf16 weights):
#  1. bench/tiers.py hostconvoy: 32 concurrent requests sharing a 4,096-token prefix that is only in the
#     host tier: block loads (the prefix read once), fewest cached tokens, worst TTFT against the same 32
#     suffixes over a prefix as long in the pool (each convoy's computed prompt tokens printed);
#  2. bench/swap-sweep.sh: the cliff past the pool's knee, preemption by swap (over PCIe) against
#     recompute, in one run (ITL p99 per concurrency in the compare report).
# Each step under half of LIMIT_S; logs and results under OUT_DIR, a summary printed last. The servers
# start with KURA_GPU_KERNELS=default (unless set): the kernel timing a GPU executor otherwise runs at
# each start launches every kernel form, which the GPU tests cover.
# Usage: scripts/gpu/tiers.sh OUT_DIR [LIMIT_S=240]
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
out=${1:?usage: scripts/gpu/tiers.sh OUT_DIR [LIMIT_S]}
limit=${2:-240}
work=${KURA_GPU_WORK:-/tmp/kura-gpu-work}
source scripts/gpu/env.sh
export KURA_CACHE_DIR="$PWD/gpu-bin/cache"
export KURA_GPU_KERNELS=${KURA_GPU_KERNELS:-default}
# Each step under its limit in a process group of its own (scripts/gpu/bounded.sh), which the timeout
# ends whole, the step's servers with it (`timeout --foreground` would end the step's first process
# alone); what of the group outlasts the step is ended after it, killed 5 s later. A TERM or INT to this
# script (a limit around it, scripts/gpu/session.sh's) goes on to that group the same way.
source scripts/gpu/bounded.sh
mkdir -p "$out" "$work"
[ -x gpu-bin/kura ] || { echo "gpu-bin/kura is missing: run scripts/gpu-build.sh and carry gpu-bin" >&2; exit 1; }
if [ ! -f "$work/llama8b4/config.json" ]; then
  python3 scripts/gpu/make_models.py "$work" gpu-bin/tokenizer >"$out/make_models.log" 2>&1 \
    || { tail -20 "$out/make_models.log"; exit 1; }
fi
model="$work/llama8b4"
bounded $((limit / 2)) python3 bench/tiers.py --kura gpu-bin/kura --model "$model" --device cuda \
  --only hostconvoy --reps 2 --json "$out/hostconvoy.json" >"$out/hostconvoy.log" 2>&1
convoy_rc=$?
# A pool of 64 MiB holds 4,096 tokens of this model (16 KiB a token): 16 requests growing to 1,024 tokens
# each outgrow it from a concurrency of 4; one concurrency below that knee and one past it (on an H200
# both modes took 50 s; four concurrencies of 1,536-token outputs did not finish in 75 s).
# bench/swap-sweep.sh polls the servers with curl: without it, it would wait out its limit.
if command -v curl >/dev/null; then
  bounded $((limit / 2)) env DEVICE=cuda MODEL="$model" KURA_BIN=gpu-bin/kura POOL=64MiB HOST=4GiB SWEEP=2,8 \
    REQUESTS=16 PROMPT=512 OUTPUT=512 BATCH=8192 OUT="$out/swap-sweep" \
    bash bench/swap-sweep.sh >"$out/swap-sweep.log" 2>&1
  sweep_rc=$?
else
  echo "no curl on this machine: bench/swap-sweep.sh needs it; the swap sweep did not run" >"$out/swap-sweep.log"
  sweep_rc=1
fi
{
  echo "== hostconvoy: exit $convoy_rc (124: over $((limit / 2)) s)"
  grep -E "host convoy" "$out/hostconvoy.log" | tail -8
  echo "== swap sweep: exit $sweep_rc (124: over $((limit / 2)) s)"
  tail -30 "$out/swap-sweep.log"
  [ -f "$out/swap-sweep/compare/compare.md" ] && head -40 "$out/swap-sweep/compare/compare.md"
} | tee "$out/summary.txt"
# At most 8 files come back from the device machine, none deeper than two folders: the summary, the
# convoy's results and the compare report as they are, everything else (logs, runs, plots) in one archive.
[ -f "$out/swap-sweep/compare/compare.md" ] && cp "$out/swap-sweep/compare/compare.md" "$out/swap-compare.md"
(cd "$out" && find . -mindepth 1 -maxdepth 1 ! -name summary.txt ! -name hostconvoy.json ! -name swap-compare.md ! -name tiers-rest.tgz \
  -printf '%P\0' | tar czf tiers-rest.tgz --null -T - --remove-files) || echo "packing $out failed" >&2
exit $((convoy_rc | sweep_rc))
