#!/usr/bin/env bash
# The model runtime side by side with llama.cpp in one run: prefill of ~128 and ~1,024 tokens and decode
# at batch 1, on 1 and 2 threads, medians of REPS runs; then Kura's batched decode (criterion) and the
# with/without KV cache ratio for a 256-token generation. Prints a markdown report on stdout.
#
# Usage: bench/runtime.sh
# Environment: REPS [3]  THREADS ["1 2"]  WEIGHTS ["native bf16"] (Kura's --weights-dtype values)
#   MODEL [scripts/fetch-model.sh]  KURA_BIN [target/release/kura]
#   PEERS [1] (0: Kura only)  BATCHED [1] (0: skip the criterion batched-decode run)
#   NO_CACHE [1] (0: skip the with/without KV cache run)
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/.." && pwd)
REPS="${REPS:-3}"
THREADS="${THREADS:-1 2}"
WEIGHTS="${WEIGHTS:-native bf16}"
PEERS="${PEERS:-1}"
BATCHED="${BATCHED:-1}"
NO_CACHE="${NO_CACHE:-1}"
MODEL="${MODEL:-$("$REPO/scripts/fetch-model.sh")}"
CACHE="${KURA_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/kura}"
KURA="${KURA_BIN:-$REPO/target/release/kura}"
if [ -z "${KURA_BIN:-}" ]; then
    (cd "$REPO" && cargo build --release -q -p kura)
fi

TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

echo "# Model runtime, $(date -u +%Y-%m-%dT%H:%MZ)"
echo
echo "Machine: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) cores;" \
    "load average before: $(cut -d' ' -f1-3 /proc/loadavg)."
echo

# Kura: prompts of 130 and 1,040 tokens (the sentence is 10 tokens, plus BOS-free join spaces).
short=$(python3 -c "print(' '.join(['The quick brown fox jumps over the lazy dog.']*13))")
long=$(python3 -c "print(' '.join(['The quick brown fox jumps over the lazy dog.']*104))")
for w in $WEIGHTS; do
    for t in $THREADS; do
        for r in $(seq "$REPS"); do
            "$KURA" generate --model "$MODEL" --kv-dtype f32 --weights-dtype "$w" --threads "$t" --prompt "$short" \
                --max-tokens 64 --ignore-eos --json >"$TMP/kura-$w-$t-short-$r.json" 2>/dev/null
            "$KURA" generate --model "$MODEL" --kv-dtype f32 --weights-dtype "$w" --threads "$t" --prompt "$long" \
                --max-tokens 16 --ignore-eos --json >"$TMP/kura-$w-$t-long-$r.json" 2>/dev/null
        done
    done
done

# llama.cpp: the Q4_1 file as shipped and an F32 copy of it.
if [ "$PEERS" = 1 ]; then
    BIN="$CACHE/peers/llama.cpp/build/bin"
    if [ ! -x "$BIN/llama-bench" ]; then
        "$HERE/peers/build-llama-cpp.sh" >&2
    fi
    F32="$CACHE/models/SmolLM2-135M-Instruct.F32.gguf"
    if [ ! -f "$F32" ]; then
        "$BIN/llama-quantize" --allow-requantize "$MODEL" "$F32" F32 >/dev/null 2>&1
    fi
    tl=$(echo "$THREADS" | tr ' ' ',')
    "$BIN/llama-bench" -m "$MODEL" -m "$F32" -t "$tl" -p 128,1024 -n 64 -r "$REPS" -o json \
        >"$TMP/llama.json" 2>/dev/null
fi

python3 - "$TMP" "$THREADS" "$PEERS" "$WEIGHTS" <<'EOF'
import json, os, statistics, sys
tmp, threads, peers, weights = sys.argv[1], sys.argv[2].split(), sys.argv[3] == "1", sys.argv[4].split()
def kura(w, t, which, key):
    vals = []
    for f in sorted(os.listdir(tmp)):
        if f.startswith(f"kura-{w}-{t}-{which}-"):
            vals.append(json.load(open(os.path.join(tmp, f)))[key])
    return statistics.median(vals)
cols = [f"Kura {w} {t}t" for w in weights for t in threads]
rows = {
    "prefill ~128": [kura(w, t, "short", "prompt_tok_per_s") for w in weights for t in threads],
    "prefill ~1,024": [kura(w, t, "long", "prompt_tok_per_s") for w in weights for t in threads],
    "decode, batch 1": [kura(w, t, "short", "decode_tok_per_s") for w in weights for t in threads],
}
if peers:
    runs = json.load(open(os.path.join(tmp, "llama.json")))
    for label in ("Q4_1", "F32"):
        for t in threads:
            cols.append(f"llama.cpp {label} {t}t")
            sel = [r for r in runs if str(r["n_threads"]) == t and
                   (("F32" in r["model_filename"]) == (label == "F32"))]
            get = lambda p, n: next(r["avg_ts"] for r in sel if r["n_prompt"] == p and r["n_gen"] == n)
            rows["prefill ~128"].append(get(128, 0))
            rows["prefill ~1,024"].append(get(1024, 0))
            rows["decode, batch 1"].append(get(0, 64))
print("tokens/s, medians (Kura) and means (llama-bench) of the runs:\n")
print("| | " + " | ".join(cols) + " |")
print("|---|" + "---:|" * len(cols))
for k, v in rows.items():
    print(f"| {k} | " + " | ".join(f"{x:,.0f}" for x in v) + " |")
print()
for w in weights:
    b = json.load(open(os.path.join(tmp, f"kura-{w}-{threads[0]}-short-1.json")))
    print(f"Kura {w} reads {b['weight_bytes_per_token']/1e6:.0f} MB of weights per decoded token.")
EOF

echo
echo "Memory read bandwidth (\`cargo bench -p kura-model --bench bandwidth\`), the numerator of the decode bound:"
echo
(cd "$REPO" && cargo bench -q -p kura-model --bench bandwidth 2>/dev/null) | sed 's/^/- /'

if [ "$BATCHED" = 1 ]; then
    echo
    echo "Batched decode (\`cargo bench -p kura-model --bench forward\`, 128 tokens of context each), tokens/s:"
    echo
    for w in $WEIGHTS; do
        for t in $THREADS; do
            (cd "$REPO" && KURA_BENCH_WEIGHTS=$w RAYON_NUM_THREADS=$t cargo bench -q -p kura-model --bench forward -- decode 2>/dev/null) |
                awk -v t="$t" '/^forward\//{name=$1} /thrpt:/ && /elem\/s/{print "- " t " thread(s), " name ": " $(NF-3) " " $(NF-2)}'
        done
    done
fi

if [ "$NO_CACHE" = 1 ]; then
    echo
    echo "With vs without the KV cache, 256 tokens after \"Once upon a time\", 1 thread:"
    echo
    with=$("$KURA" generate --model "$MODEL" --kv-dtype f32 --threads 1 --prompt "Once upon a time" --max-tokens 256 \
        --ignore-eos --json 2>/dev/null)
    without=$("$KURA" generate --model "$MODEL" --kv-dtype f32 --threads 1 --prompt "Once upon a time" --max-tokens 256 \
        --ignore-eos --json --no-kv-cache 2>/dev/null)
    python3 - "$with" "$without" <<'EOF'
import json, sys
a, b = json.loads(sys.argv[1]), json.loads(sys.argv[2])
ta, tb = a["total_ms"] / 1e3, b["total_ms"] / 1e3
same = "the same text" if a.get("text") == b.get("text") else "DIFFERENT text"
print(f"- {ta:.2f} s with, {tb:.1f} s without: {tb/ta:.1f}× ({same})")
EOF
fi
