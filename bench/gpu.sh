#!/usr/bin/env bash
# Kura's GPU benchmarks beside HF transformers on the same GPU, Llama-3.1-8B's shape with random bf16
# weights (bench/gpu/llama-3.1-8b.json): batch-1 decode after 1,024 tokens (and its share of the HBM
# bound), prefill TTFT at 4,096 and 16,384 tokens, decode at batch 64 with 1,024 tokens of context, and
# the TTFT of a 4,096-token prompt with 4,080 cached. Needs gpu-bin/ (scripts/gpu-build.sh).
# Writes the JSON lines of both to OUT_DIR (default: a temporary folder) and prints a table. With
# KURA_GPU_SERVE_MODEL set to a model directory, also runs `kura bench shared-prefix` against
# `kura serve --device cuda` on that model, decode through it at batch 64 greedy and at temperature 1
# (`kura bench unique`), and `kura sim --calibrate --device cuda` then `kura sim` on the
# same workload (bench/gpu/sim_vs_served.py prints both). A step that fails or runs past its limit (KURA_BENCH_LIMIT_S,
# KURA_HF_LIMIT_S, KURA_CALIBRATE_LIMIT_S) does not stop the next; the script then exits 1.
# KURA_GPU_BENCH_CONFIG overrides the model config. KURA_GPU_PREFLIGHT=1 (scripts/gpu/preflight.sh, on the
# CPU's stand-in driver): gpu-bench at a 32nd of its lengths (--divide 32), hf_peer.py --small, and a
# smaller shared-prefix run against a 1 GiB pool.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu/env.sh
export KURA_CACHE_DIR="$PWD/gpu-bin/cache"
out=${1:-$(mktemp -d)}
mkdir -p "$out"
failed=()
# --foreground: the command stays in this script's process group, so that a timeout around the whole
# script (scripts/gpu/all.sh) ends it too.
small=${KURA_GPU_PREFLIGHT:+1}
timeout --foreground -k 10 "${KURA_BENCH_LIMIT_S:-180}" gpu-bin/gpu-bench "${KURA_GPU_BENCH_CONFIG:-bench/gpu/llama-3.1-8b.json}" \
  ${small:+--divide 32} | tee "$out/kura.jsonl" \
  || failed+=("gpu-bench (exit ${PIPESTATUS[0]}; 124: over ${KURA_BENCH_LIMIT_S:-180} s)")
timeout --foreground -k 10 "${KURA_HF_LIMIT_S:-120}" python3 bench/gpu/hf_peer.py ${small:+--small} | tee "$out/hf.jsonl" \
  || failed+=("hf_peer.py (exit ${PIPESTATUS[0]}; 124: over ${KURA_HF_LIMIT_S:-120} s)")
python3 bench/gpu/table.py "$out/kura.jsonl" "$out/hf.jsonl" || failed+=("table.py")
if [ -n "${KURA_GPU_SERVE_MODEL:-}" ]; then
  # The simulator's cost model of this GPU, timed before the server takes the device: `kura sim` then
  # predicts the shared-prefix run below, and the two are printed side by side.
  calibrated=""
  timeout --foreground -k 10 "${KURA_CALIBRATE_LIMIT_S:-120}" gpu-bin/kura sim --calibrate --device cuda \
    --model "$KURA_GPU_SERVE_MODEL" --repeats "$([ -n "$small" ] && echo 1 || echo 3)" --cost "$out/cost-cuda.json" \
    2> "$out/calibrate.log" && calibrated=1 \
    || { tail -5 "$out/calibrate.log" >&2; failed+=("kura sim --calibrate --device cuda"); }
  if [ -n "$calibrated" ]; then grep -E '^fit:|front end' "$out/calibrate.log" || true; fi
  port=8391
  pool=8GiB
  [ -z "$small" ] || pool=1GiB # the stand-in device of KURA_GPU_PREFLIGHT has 4 GiB
  gpu-bin/kura serve --device cuda --model "$KURA_GPU_SERVE_MODEL" --port $port --kv-cache-memory "$pool" \
    > "$out/serve.log" 2>&1 &
  serve_pid=$!
  # The server goes with the script, however it ends.
  trap 'kill $serve_pid 2>/dev/null || true' EXIT
  for _ in $(seq 120); do
    kill -0 $serve_pid 2>/dev/null || break
    python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$port/health', timeout=1)" 2>/dev/null && break
    sleep 0.5
  done
  if ! kill -0 $serve_pid 2>/dev/null; then
    echo "kura serve --device cuda exited:" >&2
    tail -20 "$out/serve.log" >&2
    failed+=("kura serve --device cuda")
  else
    if [ -n "$small" ]; then shape=(--groups 2 --users-per-group 4 --system-tokens 200 --question-tokens 20 --output-tokens 8)
    else shape=(--groups 4 --users-per-group 8 --system-tokens 2000 --question-tokens 50 --output-tokens 32); fi
    gpu-bin/kura bench shared-prefix --url "http://127.0.0.1:$port" "${shape[@]}" --concurrency 8 \
      --out "$out/shared-prefix" 2>&1 | tail -25 || failed+=("kura bench shared-prefix")
    # Decode through the server at batch 64, greedy (tokens chosen on the device) and at temperature 1
    # (rows of logits copied back and sampled on the host): output tokens/s of each.
    if [ -n "$small" ]; then decode=(--requests 16 --concurrency 8 --prompt-tokens 64 --output-tokens 16)
    else decode=(--requests 128 --concurrency 64 --prompt-tokens 512 --output-tokens 128); fi
    for temperature in 0 1; do
      echo "== kura serve --device cuda, decode at temperature $temperature: kura bench unique ${decode[*]}"
      gpu-bin/kura bench unique --url "http://127.0.0.1:$port" "${decode[@]}" --temperature $temperature \
        --seed $((10 + temperature)) --quiet --out "$out/decode-t$temperature" 2>&1 | tail -5 \
        && grep -E '^\|' "$out/decode-t$temperature/summary.md" | head -4 \
        || failed+=("kura bench unique at temperature $temperature")
    done
    kill $serve_pid 2>/dev/null || true
    wait $serve_pid 2>/dev/null || true
    blocks=$(sed -n 's/.*KV cache: \([0-9]*\) blocks.*/\1/p' "$out/serve.log" | head -1)
    if [ -n "$calibrated" ] && [ -n "$blocks" ] && [ -f "$out/shared-prefix/run.json" ]; then
      gpu-bin/kura sim --workload shared-prefix "${shape[@]}" --concurrency 8 --kv-blocks "$blocks" \
        --cost "$out/cost-cuda.json" --json > "$out/sim-shared-prefix.json" \
        && python3 bench/gpu/sim_vs_served.py "$out/sim-shared-prefix.json" "$out/shared-prefix/run.json" \
        || failed+=("kura sim --workload shared-prefix with the GPU's cost model")
    else
      failed+=("kura sim against the GPU server (calibrated: ${calibrated:-no}; pool: ${blocks:-not in serve.log})")
    fi
  fi
fi
if [ ${#failed[@]} -gt 0 ]; then
  printf 'bench/gpu.sh: FAILED: %s\n' "${failed[@]}" >&2
  exit 1
fi
