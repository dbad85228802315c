#!/usr/bin/env bash
# Kura's GPU benchmarks beside HF transformers on the same GPU, Llama-3.1-8B's shape with random bf16
# weights (bench/gpu/llama-3.1-8b.json): batch-1 decode after 1,024 tokens (and its share of the HBM
# bound), prefill TTFT at 4,096 and 16,384 tokens, the TTFT of a 4,096-token prompt with 4,080 cached and
# decode at batch 64 with 1,024 tokens of context, with the default kernels, first; then gpu-bench's
# optional sections (other kernels and options, draft checks, the host tier, profiles) in the time its
# limit leaves. Needs gpu-bin/ (scripts/gpu-build.sh).
# Writes the JSON lines of both to OUT_DIR (default: a temporary folder) and prints a table. With
# KURA_GPU_SERVE_MODEL set to a model directory, also runs `kura bench shared-prefix` against
# `kura serve --device cuda` on that model, decode through it at batch 64 greedy and at temperature 1
# (`kura bench unique`), then, the server stopped, `kura sim --calibrate --device cuda` and `kura sim` on
# the same workload (bench/gpu/sim_vs_served.py prints both). The server and the calibration start with
# KURA_GPU_KERNELS=default (unless set): the kernel timing a GPU executor otherwise runs at its start
# launches every kernel form, and the GPU tests cover it.
# Time: KURA_BENCH_BUDGET_S, the seconds the whole script may take (scripts/gpu/all.sh passes its limit),
# gives gpu-bench 40 % of it (at least 90 s, or all of a budget under 90 s) and keeps 60 s for the
# served runs when HF's peer starts, and each served run keeps 20 s for the calibration; each step also
# has a limit of its own (KURA_BENCH_LIMIT_S for gpu-bench, 180 s without a budget; KURA_HF_LIMIT_S, 120;
# KURA_CALIBRATE_LIMIT_S, 120), and gpu-bench skips its optional sections that would end within 15 s of
# its limit (--within). A step that fails, runs past its limit or finds no time left does not stop the
# next; the script then exits 1.
# KURA_GPU_BENCH_CONFIG overrides the model config. KURA_GPU_PREFLIGHT=1 (scripts/gpu/preflight.sh, on the
# CPU's stand-in driver): gpu-bench at a 32nd of its lengths (--divide 32), hf_peer.py --small, and a
# smaller shared-prefix run against a 1 GiB pool.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu/env.sh
export KURA_CACHE_DIR="$PWD/gpu-bin/cache"
export KURA_GPU_KERNELS=${KURA_GPU_KERNELS:-default}
out=${1:-$(mktemp -d)}
mkdir -p "$out"
failed=()
start=$(date +%s)
budget=${KURA_BENCH_BUDGET_S:-}
case "$budget" in '' | [1-9] | [1-9]*[0-9]) ;; *) echo "KURA_BENCH_BUDGET_S: whole seconds, got '$budget'" >&2; exit 2 ;; esac
# Seconds left of the budget (without one, a day).
left() { echo $(( ${budget:-86400} - ($(date +%s) - start) )); }
# A step's limit: LIMIT, or less where the budget leaves less after KEEP seconds for the steps after it
# (at least 1: `timeout 0` would not limit it).
cap() { local l=$(( $(left) - $2 )); l=$(( $1 < l ? $1 : l )); echo $(( l < 1 ? 1 : l )); }
# --foreground: the command stays in this script's process group, so that a timeout around the whole
# script (scripts/gpu/all.sh) ends it too (none of these commands starts processes of its own).
small=${KURA_GPU_PREFLIGHT:+1}
# With a budget: 40 % of it, but at least 90 s (or the whole budget where it is less), so that a short
# budget still leaves the figures the GPU is judged by their time (about 20 s, the weights made, plus
# the device's setup).
if [ -n "${KURA_BENCH_LIMIT_S:-}" ]; then bench_limit=$KURA_BENCH_LIMIT_S
elif [ -n "$budget" ]; then
  bench_limit=$((budget * 40 / 100))
  floor=$((budget < 90 ? budget : 90))
  [ "$bench_limit" -ge "$floor" ] || bench_limit=$floor
else bench_limit=180; fi
bench_limit=$(cap "$bench_limit" 0)
within=$((bench_limit > 45 ? bench_limit - 15 : bench_limit * 2 / 3))
[ "$within" -ge 1 ] || within=1
timeout --foreground -k 10 "$bench_limit" gpu-bin/gpu-bench "${KURA_GPU_BENCH_CONFIG:-bench/gpu/llama-3.1-8b.json}" \
  ${small:+--divide 32} --within "$within" | tee "$out/kura.jsonl" \
  || failed+=("gpu-bench (exit ${PIPESTATUS[0]}; 124: over $bench_limit s)")
served=$([ -n "${KURA_GPU_SERVE_MODEL:-}" ] && echo 60 || echo 0)
hf_limit=$(cap "${KURA_HF_LIMIT_S:-120}" "$served")
if [ "$hf_limit" -ge 20 ]; then
  timeout --foreground -k 10 "$hf_limit" python3 bench/gpu/hf_peer.py ${small:+--small} | tee "$out/hf.jsonl" \
    || failed+=("hf_peer.py (exit ${PIPESTATUS[0]}; 124: over $hf_limit s)")
else
  failed+=("hf_peer.py not run: $(left) s left of $budget, $served s of them kept for the served runs")
  : >"$out/hf.jsonl"
fi
python3 bench/gpu/table.py "$out/kura.jsonl" "$out/hf.jsonl" || failed+=("table.py")
if [ -n "${KURA_GPU_SERVE_MODEL:-}" ]; then
  port=8391
  pool=8GiB
  [ -z "$small" ] || pool=1GiB # the stand-in device of KURA_GPU_PREFLIGHT has 4 GiB
  if [ -n "$small" ]; then shape=(--groups 2 --users-per-group 4 --system-tokens 200 --question-tokens 20 --output-tokens 8)
  else shape=(--groups 4 --users-per-group 8 --system-tokens 2000 --question-tokens 50 --output-tokens 32); fi
  gpu-bin/kura serve --device cuda --model "$KURA_GPU_SERVE_MODEL" --port $port --kv-cache-memory "$pool" \
    > "$out/serve.log" 2>&1 &
  serve_pid=$!
  # The server goes with the script, however it ends.
  trap 'kill $serve_pid 2>/dev/null || true' EXIT
  for _ in $(seq 120); do
    kill -0 $serve_pid 2>/dev/null || break
    [ "$(left)" -gt 10 ] || break
    python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$port/health', timeout=1)" 2>/dev/null && break
    sleep 0.5
  done
  if ! python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$port/health', timeout=1)" 2>/dev/null; then
    echo "kura serve --device cuda did not answer (its log's end):" >&2
    tail -20 "$out/serve.log" >&2
    failed+=("kura serve --device cuda")
  else
    # Each served run keeps 20 s back for the calibration after the server (which needs 15), and does
    # not start with less than 10 s.
    limit=$(cap 120 20)
    if [ "$limit" -lt 10 ]; then
      failed+=("kura bench shared-prefix not run: $(left) s left of $budget, 20 s of them kept for the calibration")
    else
      timeout --foreground -k 5 "$limit" gpu-bin/kura bench shared-prefix --url "http://127.0.0.1:$port" "${shape[@]}" \
        --concurrency 8 --out "$out/shared-prefix" 2>&1 | tail -25 \
        || failed+=("kura bench shared-prefix (exit ${PIPESTATUS[0]}; 124: over $limit s)")
    fi
    # Decode through the server at batch 64, greedy (tokens chosen on the device) and at temperature 1
    # (rows of logits copied back and sampled on the host): output tokens/s of each.
    if [ -n "$small" ]; then decode=(--requests 16 --concurrency 8 --prompt-tokens 64 --output-tokens 16)
    else decode=(--requests 128 --concurrency 64 --prompt-tokens 512 --output-tokens 128); fi
    for temperature in 0 1; do
      limit=$(cap 60 20)
      if [ "$limit" -lt 10 ]; then
        failed+=("kura bench unique at temperature $temperature not run: $(left) s left of $budget, 20 s of them kept for the calibration")
        continue
      fi
      echo "== kura serve --device cuda, decode at temperature $temperature: kura bench unique ${decode[*]}"
      timeout --foreground -k 5 "$limit" gpu-bin/kura bench unique --url "http://127.0.0.1:$port" "${decode[@]}" \
        --temperature $temperature --seed $((10 + temperature)) --quiet --out "$out/decode-t$temperature" 2>&1 | tail -5 \
        && grep -E '^\|' "$out/decode-t$temperature/summary.md" | head -4 \
        || failed+=("kura bench unique at temperature $temperature")
    done
  fi
  # The server ends on a TERM once its requests are done: 10 s for that, then it is killed.
  kill $serve_pid 2>/dev/null || true
  for _ in $(seq 100); do
    kill -0 $serve_pid 2>/dev/null || break
    sleep 0.1
  done
  if kill -0 $serve_pid 2>/dev/null; then
    echo "kura serve --device cuda still running 10 s after its TERM: killed" >&2
    kill -KILL $serve_pid 2>/dev/null || true
  fi
  wait $serve_pid 2>/dev/null || true
  trap - EXIT
  # The simulator's cost model of this GPU, timed with the device to itself (the server stopped): `kura
  # sim` then predicts the shared-prefix run above, and the two are printed side by side.
  blocks=$(sed -n 's/.*KV cache: \([0-9]*\) blocks.*/\1/p' "$out/serve.log" | head -1)
  limit=$(cap "${KURA_CALIBRATE_LIMIT_S:-120}" 5)
  if [ ! -f "$out/shared-prefix/run.json" ] || [ -z "$blocks" ]; then
    failed+=("kura sim against the GPU server not run (no shared-prefix run, or no pool in serve.log)")
  elif [ "$limit" -lt 15 ]; then
    failed+=("kura sim --calibrate --device cuda not run: $(left) s left of $budget")
  elif timeout --foreground -k 10 "$limit" gpu-bin/kura sim --calibrate --device cuda \
      --model "$KURA_GPU_SERVE_MODEL" --repeats "$([ -n "$small" ] && echo 1 || echo 3)" --cost "$out/cost-cuda.json" \
      2> "$out/calibrate.log"; then
    grep -E '^fit:|front end' "$out/calibrate.log" || true
    gpu-bin/kura sim --workload shared-prefix "${shape[@]}" --concurrency 8 --kv-blocks "$blocks" \
      --cost "$out/cost-cuda.json" --json > "$out/sim-shared-prefix.json" \
      && python3 bench/gpu/sim_vs_served.py "$out/sim-shared-prefix.json" "$out/shared-prefix/run.json" \
      || failed+=("kura sim --workload shared-prefix with the GPU's cost model")
  else
    tail -5 "$out/calibrate.log" >&2
    failed+=("kura sim --calibrate --device cuda (124: over $limit s)")
  fi
fi
echo "bench/gpu.sh: $(( $(date +%s) - start )) s${budget:+ of $budget}"
if [ ${#failed[@]} -gt 0 ]; then
  printf 'bench/gpu.sh: FAILED: %s\n' "${failed[@]}" >&2
  exit 1
fi
