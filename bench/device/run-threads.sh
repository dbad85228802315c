#!/usr/bin/env bash
# Kura vs llama.cpp across thread counts (bench/threads.sh) on a machine with no network, cargo or compiler
# (the lent 16-core x86-64 machine), from device-kit/ (bench/device/make-kit.sh, carried with the tree).
# The default model (a 98 MB GGUF) cannot be carried, so it is made here in its shape:
#   1. a random HF Llama model in SmolLM2-135M-Instruct's shape (bench/device/make_model.py: torch +
#      transformers), with the default model's tokenizer files
#   2. to GGUF (f16) with llama.cpp's convert_hf_to_gguf.py (the kit's copy, with its gguf-py)
#   3. to Q4_1 with llama-quantize: the default model's quantization, the file Kura and llama-bench read
#      (same tensors, types and shapes as the default model's file; random values)
#   4. bench/threads.sh with the kit's kura, llama-bench and bandwidth bench, in two passes with a step
#      between:
#      a. THREADS ["1 2 4 8 12 16"], REPS [3], PROMPTS ["1024"], DECODE [1024]: decode of DECODE tokens,
#         prefill of ~1,024 tokens, the decode bound, the "default" row -> OUT_DIR/threads.md
#      b. the chunk grain of decode products (crates/kura-model/src/kernels/team.rs, CHUNK_BYTES): the
#         products bench in L2 at each of THREADS with chunks of down to one panel (KURA_CHUNK_BYTES=1)
#         and at the default, then Kura's decode alone at GRAIN_THREADS [the two largest of THREADS]
#         with KURA_CHUNK_BYTES=1 (against pass a's rows) -> OUT_DIR/grain.md
#      c. LONG_THREADS ["1 4 16"], LONG_REPS [1], LONG_PROMPTS ["4096"] -> OUT_DIR/threads-long.md
#         (LONG_PROMPTS="" skips it). Prefill of ~4,096 tokens is what costs: at 1 thread on a 2-core
#         AMD EPYC (shared) llama-bench took 63 s per run and runs it REPS + 1 times (a warm-up run),
#         Kura 38 s; all six counts at REPS=3 in one pass were estimated at 9-17 minutes on 16 cores,
#         past the device tool's 10-minute command. Pass c stops at DEADLINE_S [540] s after the start
#         (pass a's and step b's reports are written then). FULL=1: one pass, THREADS with REPS and
#         PROMPTS ["1024 4096"] (no deadline).
# Usage (from the repository root): bench/device/run-threads.sh OUT_DIR
# Writes OUT_DIR/threads.md, grain.md (+ threads-long.md), OUT_DIR/run.log (steps, timings, the llama.cpp CPU
# variant) and OUT_DIR/model.txt (the model's tensor types). Environment also: KIT [device-kit]
#   WORK [/tmp/kura-device-model] (the model files; a finished Q4_1 there is reused) PYTHON [python3]
#   (with torch + transformers) LAYERS (a model of fewer layers, for a quick test) GRAIN_THREADS (step b).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT="${1:?usage: bench/device/run-threads.sh OUT_DIR}"
KIT="${KIT:-device-kit}"
# device-kit/ may have travelled packed (scripts/gpu/pack.sh, beside gpu-bin/).
bash scripts/gpu/unpack.sh
KIT=$(cd "$KIT" && pwd)
WORK="${WORK:-/tmp/kura-device-model}"
PY="${PYTHON:-python3}"
FULL="${FULL:-0}"
export THREADS="${THREADS:-1 2 4 8 12 16}" REPS="${REPS:-3}"
# Decode runs of 1,024 tokens: a decode step of the small model takes about half a millisecond on 16
# cores, and the team size of its steps settles by trials in the first few hundred
# (crates/kura-model/src/kernels/pace.rs); llama-bench decodes as many.
export DECODE="${DECODE:-1024}"
if [ "$FULL" = 1 ]; then
  export PROMPTS="${PROMPTS:-1024 4096}"
  LONG_PROMPTS=""
else
  export PROMPTS="${PROMPTS:-1024}"
  LONG_PROMPTS="${LONG_PROMPTS-4096}"
fi
# shellcheck disable=SC2086
GRAIN_THREADS="${GRAIN_THREADS:-$(printf '%s\n' $THREADS | sort -n | tail -2 | xargs)}"
LONG_THREADS="${LONG_THREADS:-1 4 16}" LONG_REPS="${LONG_REPS:-1}" DEADLINE_S="${DEADLINE_S:-540}"
mkdir -p "$OUT" "$WORK"
OUT=$(cd "$OUT" && pwd)
LOG="$OUT/run.log"
export LD_LIBRARY_PATH="$KIT/llama${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
for f in kura bandwidth products llama/llama-bench llama/llama-quantize convert/convert_hf_to_gguf.py make_model.py \
  tokenizer/tokenizer.json; do
  [ -e "$KIT/$f" ] || { echo "run-threads: $KIT/$f is missing (bench/device/make-kit.sh makes the kit)" >&2; exit 1; }
done

start=$SECONDS
log() { echo "run-threads [$((SECONDS - start)) s]: $*" | tee -a "$LOG" >&2; }
: >"$LOG"
log "$(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs); THREADS='$THREADS' REPS=$REPS DECODE=$DECODE PROMPTS='$PROMPTS'; LONG_THREADS='$LONG_THREADS' LONG_REPS=$LONG_REPS LONG_PROMPTS='$LONG_PROMPTS'"
[ -f "$KIT/README.txt" ] && head -1 "$KIT/README.txt" >>"$LOG"

Q4="$WORK/model.Q4_1.gguf"
if [ -f "$Q4" ]; then
  log "reusing $Q4"
else
  log "1/4 random HF model (torch + transformers)"
  rm -rf "$WORK/hf"
  "$PY" "$KIT/make_model.py" "$WORK/hf" "$KIT/tokenizer" ${LAYERS:+--layers "$LAYERS"} 2>&1 | tee -a "$LOG" >&2
  log "2/4 convert_hf_to_gguf.py to f16"
  PYTHONPATH="$KIT/convert/gguf-py${PYTHONPATH:+:$PYTHONPATH}" "$PY" "$KIT/convert/convert_hf_to_gguf.py" \
    "$WORK/hf" --outtype f16 --outfile "$WORK/model.f16.gguf" >"$WORK/convert.log" 2>&1 \
    || { tail -30 "$WORK/convert.log" | tee -a "$LOG" >&2; exit 1; }
  grep -iE "pre-tokenizer|chkhsh|warning" "$WORK/convert.log" | head -5 >>"$LOG" || true
  log "3/4 llama-quantize to Q4_1"
  "$KIT/llama/llama-quantize" "$WORK/model.f16.gguf" "$Q4.part" Q4_1 "$(nproc)" >"$WORK/quantize.log" 2>&1 \
    || { tail -30 "$WORK/quantize.log" | tee -a "$LOG" >&2; exit 1; }
  mv "$Q4.part" "$Q4"
  rm -rf "$WORK/hf" "$WORK/model.f16.gguf"
fi
log "model: $(du -h "$Q4" | cut -f1) $Q4"
# The tensor types (token_embd Q8_0 and blocks Q4_1 in the default model) and llama.cpp's CPU variant.
PYTHONPATH="$KIT/convert/gguf-py" "$PY" - "$Q4" >"$OUT/model.txt" 2>&1 <<'EOF' || true
import collections, sys
from gguf import GGUFReader
r = GGUFReader(sys.argv[1])
kinds = collections.Counter()
for t in r.tensors:
    kinds[(t.name.split(".")[-2] if t.name.startswith("blk.") else t.name, t.tensor_type.name)] += 1
for (name, ty), n in sorted(kinds.items()):
    print(f"{name:24} {ty:6} x{n}")
EOF
cat "$OUT/model.txt" >>"$LOG"
"$KIT/llama/llama-bench" -m "$Q4" -t 1 -p 8 -n 0 -r 1 2>&1 | grep -m1 "load_backend: loaded CPU" >>"$LOG" || true
tail -1 "$LOG" >&2

export KURA_BIN="$KIT/kura" LLAMA_BIN="$KIT/llama" BANDWIDTH_BIN="$KIT/bandwidth" MODEL="$Q4"
log "4/4 bench/threads.sh: THREADS='$THREADS' REPS=$REPS PROMPTS='$PROMPTS'"
bench/threads.sh >"$OUT/threads.md"
log "done: $OUT/threads.md"
cat "$OUT/threads.md"
# The products bench with its weights in L2 at each of THREADS, with the environment assignments given
# (none: the default grain, whatever the caller's environment holds), in a markdown code block.
products_in_l2() {
  echo '```'
  env -u KURA_CHUNK_BYTES "$@" KURA_PRODUCTS_IN_CACHE=1 KURA_BANDWIDTH_THREADS="$THREADS" "$KIT/products" --bench 2>&1 \
    | grep 'thread(s)'
  echo '```'
}
log "4/4 b. the chunk grain: the products bench at THREADS='$THREADS', then decode at GRAIN_THREADS='$GRAIN_THREADS' with KURA_CHUNK_BYTES=1"
{
  echo "# The chunk grain of decode products"
  echo
  echo "The products bench in L2 (\`KURA_PRODUCTS_IN_CACHE=1\`), chunks of down to one panel, then the default grain:"
  echo
  echo "KURA_CHUNK_BYTES=1:"
  products_in_l2 KURA_CHUNK_BYTES=1
  echo "The default grain:"
  products_in_l2
  echo
  echo "Kura's decode with KURA_CHUNK_BYTES=1 (the default grain's rows are threads.md's):"
  echo
  KURA_CHUNK_BYTES=1 PEERS=0 THREADS="$GRAIN_THREADS" PROMPTS=1024 bench/threads.sh
} >"$OUT/grain.md" 2>>"$LOG" || log "the grain step failed (its output so far is in grain.md)"
log "done: $OUT/grain.md"
cat "$OUT/grain.md"
if [ -n "$LONG_PROMPTS" ]; then
  left=$((DEADLINE_S - SECONDS + start))
  log "4/4 bench/threads.sh: THREADS='$LONG_THREADS' REPS=$LONG_REPS PROMPTS='$LONG_PROMPTS' (stopped after $left s)"
  if [ "$left" -gt 10 ] && THREADS="$LONG_THREADS" REPS="$LONG_REPS" PROMPTS="$LONG_PROMPTS" \
      timeout "$left" bench/threads.sh >"$OUT/threads-long.md.part"; then
    mv "$OUT/threads-long.md.part" "$OUT/threads-long.md"
    log "done: $OUT/threads-long.md"
    echo
    cat "$OUT/threads-long.md"
  else
    rm -f "$OUT/threads-long.md.part"
    log "the long-prompt pass did not finish by DEADLINE_S=$DEADLINE_S s: no threads-long.md"
  fi
fi
