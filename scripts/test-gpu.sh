#!/usr/bin/env bash
# Kura's GPU tests, on a machine with an NVIDIA GPU; fails, saying so, where there is none.
#
# Runs what scripts/gpu-build.sh put in gpu-bin/ (built on any machine and carried; built here first when
# gpu-bin/ is missing and cargo is present):
#  1. scripts/gpu/make_models.py: random bf16 models in SmolLM2-135M's shape and in Llama-3.1-8B's cut to
#     4 layers, with HF transformers' logits and greedy tokens for three prompts (the reference);
#  2. the CUDA executor's tests (crates/kura-cuda/tests/gpu.rs): logits against the CPU runtime and HF,
#     both attention kernels, greedy tokens cold / cached / chunked / batched / every block size, block
#     export, import and copy-on-write, errors;
#  3. `kura serve --device cuda` through the official openai client: exact cached_tokens, the pool against
#     `kura plan --gpu`, revisits served from the host tier (asynchronous copies) with the cold text, and
#     `kura generate --device cuda` giving the GPU server's prompt tokens and text;
#  4. `kura perplexity --device cuda` on the small model: f32 KV against the f32 reference exact (the GPU
#     path is deterministic), bf16 and fp8 finite.
# Usage: scripts/test-gpu.sh [WORK_DIR] (default a temporary folder).
# KURA_GPU_PREFLIGHT=1 (scripts/gpu/preflight.sh, on the CPU's stand-in driver): the models cut to 2 layers
# (make_models.py --preflight) and each test given 600 s.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu/env.sh
if [ ! -x gpu-bin/kura-cuda-gpu-tests ]; then
  command -v cargo >/dev/null || { echo "gpu-bin/ is missing: run scripts/gpu-build.sh first" >&2; exit 1; }
  scripts/gpu-build.sh
fi
export KURA_CACHE_DIR="$PWD/gpu-bin/cache"
work=${1:-$(mktemp -d)}
mkdir -p "$work"
start=$(date +%s)
echo "== models and HF references ($work)"
python3 scripts/gpu/make_models.py "$work" gpu-bin/tokenizer ${KURA_GPU_PREFLIGHT:+--preflight}
failed=()
echo "== CUDA executor tests"
# One process a test, each under a time limit (KURA_GPU_TEST_LIMIT_S): a test that hangs, or leaves a
# sticky CUDA error in the process's (primary) context, or aborts, costs only itself. --foreground keeps
# it in this script's process group, so that a timeout around the whole script ends it too.
tests=$(gpu-bin/kura-cuda-gpu-tests --ignored --list --format terse | sed -n 's/: test$//p' || true)
[ -n "$tests" ] || failed+=("executor tests (none listed)")
# The tests of what has never run on a GPU first (KURA_GPU_TESTS_FIRST overrides the list), then the
# others in their listed order: where a session's time limit cuts the run, it cuts tests that have passed
# on a device before.
first=${KURA_GPU_TESTS_FIRST-a_draft_checks_rows_are_each_positions_logits_in_one_step \
kernel_tuning_on_the_gpu_runs_forms_with_the_default_kernels_bits \
the_fused_decode_kernels_give_the_same_bits_as_the_separate_ones \
the_half_tile_and_small_prefill_kernels_give_the_narrow_and_the_wide_kernels_bits \
fp8_kv_stays_as_close_to_bf16_as_the_cpus_fp8_and_moves_byte_for_byte \
host_tier_loads_ordered_layer_by_layer_are_read_by_the_next_step_bit_for_bit \
host_tier_loads_and_stores_copy_asynchronously_through_pinned_memory_byte_for_byte \
a_host_tier_store_holds_back_only_the_work_that_writes_its_block \
host_tier_loads_and_stores_go_both_ways_at_once_and_keep_their_order_where_it_matters \
every_positions_logits_are_each_prefixs_last_logits}
listed=" $(echo $tests) "
ordered=""
for t in $first; do
  case "$listed" in *" $t "*) ordered="$ordered $t" ;; *) echo "KURA_GPU_TESTS_FIRST: no test $t" >&2 ;; esac
done
for t in $tests; do
  case " $ordered " in *" $t "*) ;; *) ordered="$ordered $t" ;; esac
done
# KURA_GPU_TESTS_LEFT_OUT: tests not run here, each named in the log as left out (scripts/gpu/preflight.sh:
# those the CPU's stand-in runs too slowly).
tests=""
for t in $ordered; do
  case " ${KURA_GPU_TESTS_LEFT_OUT:-} " in
    *" $t "*) echo "test $t ... LEFT OUT (KURA_GPU_TESTS_LEFT_OUT)" ;;
    *) tests="$tests $t" ;;
  esac
done
for t in ${KURA_GPU_TESTS_LEFT_OUT:-}; do
  case "$listed" in *" $t "*) ;; *) echo "KURA_GPU_TESTS_LEFT_OUT: no test $t" >&2; failed+=("KURA_GPU_TESTS_LEFT_OUT names no test $t") ;; esac
done
limit=${KURA_GPU_TEST_LIMIT_S:-$([ -n "${KURA_GPU_PREFLIGHT:-}" ] && echo 600 || echo 60)}
for t in $tests; do
  rc=0
  KURA_GPU_MODELS="$work" timeout --foreground -k 10 "$limit" \
    gpu-bin/kura-cuda-gpu-tests --ignored --exact "$t" --test-threads=1 --nocapture || rc=$?
  if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
    echo "test $t ... TIMED OUT (over $limit s)"
    failed+=("$t (timed out)")
  elif [ $rc -ne 0 ]; then
    failed+=("$t")
  fi
done
echo "== kura serve --device cuda with the openai client"
if ! python3 -c 'import openai' 2>/dev/null && [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/kura-site .whl/*.whl \
    || echo "installing .whl/ failed" >&2
  export PYTHONPATH=/tmp/kura-site${PYTHONPATH:+:$PYTHONPATH}
fi
if ! python3 -c 'import openai' 2>/dev/null; then
  echo "the openai client is not installed and no .whl folder travelled (scripts/gpu/fetch-wheels.sh makes it)" >&2
  failed+=("kura serve --device cuda (no openai client)")
else
  python3 scripts/gpu/serve_check.py gpu-bin/kura "$work/smol" || failed+=("kura serve --device cuda")
fi
echo "== kura perplexity --device cuda"
python3 - "$work" <<'EOF' || failed+=("kura perplexity --device cuda")
import json, os, random, subprocess, sys
work = sys.argv[1]
random.seed(0)
words = "the cache of keys and values is kept in blocks on a device for later".split()
with open(f"{work}/text.txt", "w") as f:
    f.write(" ".join(random.choice(words) for _ in range(4000)))
cmd = ["gpu-bin/kura", "perplexity", "--model", f"{work}/smol", "--text", f"{work}/text.txt",
       "--device", "cuda", "--context", "256", "--chunks", "2", "--kv-dtype", "f32,bf16,fp8", "--json"]
# The default kernels, untimed: the kernel timing at a start is the tuning test's and the server check's.
env = {**os.environ, "KURA_GPU_KERNELS": os.environ.get("KURA_GPU_KERNELS", "default")}
out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
if out.returncode != 0:
    print(out.stderr[-3000:])
    sys.exit(1)
report = json.loads(out.stdout)
print(json.dumps(report, indent=1))
formats = {f["kv_dtype"]: f for f in report["formats"]}
exact = formats["f32"]["kl_mean"] == 0 and formats["f32"]["perplexity_change_pct"] == 0
finite = all(0 < f["perplexity"] < float("inf") for f in report["formats"])
print("f32 against the f32 reference exact:", exact, "; every perplexity finite:", finite)
sys.exit(0 if exact and finite else 1)
EOF
if [ ${#failed[@]} -gt 0 ]; then
  echo "== GPU tests FAILED: ${failed[*]} ($(( $(date +%s) - start )) s)"
  exit 1
fi
echo "== all GPU tests passed in $(( $(date +%s) - start )) s"
