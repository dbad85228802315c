#!/usr/bin/env bash
# Kura's CPU decode across thread counts, alone (no llama.cpp peer): the short form of
# bench/device/run-threads.sh that a GPU session's call (scripts/gpu/session.sh) runs in the time its GPU
# steps leave, with no model to make. It runs `kura generate --device cpu --json` on a model the GPU
# tests made there (random bf16 weights in SmolLM2-135M's shape, read as bf16), DECODE tokens after a
# short prompt, at each of THREADS and at the default count (no --threads), REPS rounds with the counts in
# turn, and prints a table: median decode tokens/s, the best count's share, the team size decode steps
# settled on (`pace`) and how often a compute thread gave its core away (`gave_way`).
# Stops starting runs DEADLINE_S seconds after its start, and a run still going 20 s past it is stopped
# (the table covers the runs that finished; why a run failed goes to OUT_JSONL.log).
# Usage: bench/device/kura-threads.sh KURA_BIN MODEL OUT_JSONL
# Environment: THREADS ["1 2 4 8 12 16", those up to the cores]  REPS [3]  DECODE [512]  DEADLINE_S [90]
set -euo pipefail
kura=${1:?usage: bench/device/kura-threads.sh KURA_BIN MODEL OUT_JSONL}
model=${2:?usage: bench/device/kura-threads.sh KURA_BIN MODEL OUT_JSONL}
out=${3:?usage: bench/device/kura-threads.sh KURA_BIN MODEL OUT_JSONL}
cores=$(nproc)
if [ -z "${THREADS:-}" ]; then
  THREADS=""
  for t in 1 2 4 8 12 16; do [ "$t" -le "$cores" ] && THREADS="$THREADS $t"; done
fi
reps=${REPS:-3}
decode=${DECODE:-512}
deadline=${DEADLINE_S:-90}
for v in $THREADS "$reps" "$decode" "$deadline"; do
  case "$v" in '' | *[!0-9]* | 0) echo "kura-threads.sh: counts are whole numbers above 0, got '$v'" >&2; exit 2 ;; esac
done
start=$(date +%s)
: >"$out"
: >"$out.log"
prompt="The cache of keys and values is kept in blocks on the device, and a prompt that shares a prefix"
for rep in $(seq "$reps"); do
  for t in $THREADS default; do
    if [ $(($(date +%s) - start)) -ge "$deadline" ]; then
      echo "kura-threads.sh: ${deadline} s passed; round $rep stopped before ${t}" >&2
      break 2
    fi
    args=()
    [ "$t" = default ] || args=(--threads "$t")
    if ! timeout -k 5 $((deadline - ($(date +%s) - start) + 20)) "$kura" generate --device cpu --model "$model" \
      --prompt "$prompt" --max-tokens "$decode" --ignore-eos --json "${args[@]}" 2>>"$out.log" | python3 -c 'import json, sys
r = json.loads(sys.stdin.read()); r.pop("text", None); r["asked"] = sys.argv[1]; print(json.dumps(r))' "$t" >>"$out"; then
      echo "kura-threads.sh: kura generate at ${t} threads failed" >&2
    fi
  done
done
python3 - "$out" "$cores" <<'EOF'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
if not rows:
    sys.exit("kura-threads.sh: no run finished")
by = {}
for r in rows:
    by.setdefault(r["asked"], []).append(r)
medians = {k: statistics.median(r["decode_tok_per_s"] for r in v) for k, v in by.items()}
counted = [v for k, v in medians.items() if k != "default"]
if not counted:
    sys.exit("kura-threads.sh: no run at a named thread count finished")
best = max(counted)
print(f"Kura decode on this CPU ({sys.argv[2]} CPUs), {rows[0]['generated_tokens']} tokens, {rows[0]['weights_dtype']} weights "
      f"({rows[0]['weight_bytes_per_token'] / 1e6:.0f} MB read a token), medians of each count's runs:")
print("| threads | runs | decode tok/s | of the best | pace size | gave way |")
print("|---|---:|---:|---:|---|---|")
for k, v in by.items():
    label = f"default ({v[0]['threads']})" if k == "default" else k
    sizes = ",".join(str(r["pace"]["size"]) for r in v)
    gave = ",".join(str(r["gave_way"]["same_cpu"] + r["gave_way"]["shared_core"]) for r in v)
    print(f"| {label} | {len(v)} | {medians[k]:.1f} | {medians[k] / best:.0%} | {sizes} | {gave} |")
EOF
