#!/usr/bin/env bash
# Quantized KV on the default model, in one run: what each format costs in quality (`kura perplexity` on
# the evaluation text, every format in lockstep with an f32-KV reference, at three contexts) and what it
# buys in decode speed (crates/kura-model/benches/kv_dtype.rs: batch 8 at 4,096 tokens of context and
# batch 1 at 512, every format timed in the same run as bf16, REPS runs per thread count). Prints a
# markdown report on stdout; the perplexity JSON goes to OUT.
#
# Usage: bench/kv-quant.sh
# Environment: REPS [2]  THREADS ["2 1"]  FORMATS [bf16,int8,fp8,int4]
#   CONTEXTS ["512:48 2048:12 8192:3"] (context:chunks; each chunk scores its second half)
#   OUT [docs/bench/kv-quant]  PPL [1] (0: speed only)  SPEED [1] (0: quality only)
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/.." && pwd)
REPS="${REPS:-2}"
THREADS="${THREADS:-2 1}"
FORMATS="${FORMATS:-bf16,int8,fp8,int4}"
CONTEXTS="${CONTEXTS:-512:48 2048:12 8192:3}"
OUT="${OUT:-$REPO/docs/bench/kv-quant}"
PPL="${PPL:-1}"
SPEED="${SPEED:-1}"
export KURA_MODEL="${KURA_MODEL:-$("$REPO/scripts/fetch-model.sh")}"
TEXT=$("$REPO/scripts/fetch-eval-text.sh")
mkdir -p "$OUT"
(cd "$REPO" && cargo build --release -q -p kura)
KURA="$REPO/target/release/kura"

echo "# Quantized KV, $(date -u +%Y-%m-%dT%H:%MZ)"
echo
echo "Load before: $(uptime | sed 's/.*load average: //')"
echo
if [ "$PPL" = 1 ]; then
    echo "## Quality against f32 KV (kura perplexity, weights bf16, 2 threads)"
    echo
    echo "| context | chunks | scored tokens | format | bytes/token | perplexity | change | KL mean (nats) | top-1 |"
    echo "|---:|---:|---:|---|---:|---:|---:|---:|---:|"
    for spec in $CONTEXTS; do
        ctx=${spec%%:*}
        chunks=${spec##*:}
        json="$OUT/perplexity-$ctx.json"
        "$KURA" perplexity --text "$TEXT" --context "$ctx" --chunks "$chunks" --kv-dtype "$FORMATS" \
            --weights-dtype bf16 --threads 2 --json > "$json"
        python3 - "$json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print(f"| {r['context']} | {r['chunks']} | {r['scored_tokens']} | f32 (reference) | | {r['reference_perplexity']:.4f} | | | |")
for f in r["formats"]:
    print(f"| {r['context']} | {r['chunks']} | {r['scored_tokens']} | {f['kv_dtype']} | {f['kv_bytes_per_token']} | "
          f"{f['perplexity']:.4f} | {f['perplexity_change_pct']:+.3f} % | {f['kl_mean']:.5f} | {100 * f['top1_agreement']:.2f} % |")
PY
    done
    echo
fi
if [ "$SPEED" = 1 ]; then
    echo "## Decode speed (cargo bench -p kura-model --bench kv_dtype; median ms per step of 7 rounds)"
    echo
    (cd "$REPO" && cargo bench -q -p kura-model --bench kv_dtype --no-run 2>/dev/null)
    for t in $THREADS; do
        for r in $(seq "$REPS"); do
            echo "Run $r, $t thread(s), load $(uptime | sed 's/.*load average: //'):"
            echo '```'
            (cd "$REPO" && RAYON_NUM_THREADS=$t KURA_BENCH_KV="$FORMATS" cargo bench -q -p kura-model \
                --bench kv_dtype 2>/dev/null | grep '^decode')
            echo '```'
        done
    done
fi
