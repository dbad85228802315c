#!/usr/bin/env bash
# Kura and llama.cpp across thread counts in one run, on one model file: batch-1 decode, prefill of
# ~1,024 and ~4,096 tokens, medians of REPS runs (llama-bench: means of its REPS repetitions), the ratio
# Kura / llama.cpp, and decode as a share of the bound that memory read bandwidth sets (the highest of three
# bandwidth measurements at that thread count / weight bytes read per token, all in the same run), and how
# often Kura's compute threads gave their core away in the decode runs (`kura generate --json`'s
# `gave_way`) and the team size their decode steps settled on (`pace`). Prints a markdown report.
#
# Usage: bench/threads.sh
# Environment: THREADS ["1 2 … up to the cores"]  REPS [3]  PROMPTS ["1024 4096"]  DECODE [256] (tokens
#   decoded a run, by Kura and by llama-bench)
#   MODEL [scripts/fetch-model.sh]  KURA_BIN [target/release/kura]  PEERS [1] (0: Kura only)
#   KURA_ISA is passed on to Kura (narrows its kernels); with KURA_ISA=avx2 the peer is llama.cpp built
#   for AVX2 alone (ISA=avx2 bench/peers/build-llama-cpp.sh). LLAMA_BIN: a directory holding another
#   llama-bench to use. BANDWIDTH_BIN: the bandwidth bench's binary, built elsewhere (`cargo bench -p
#   kura-model --bench bandwidth --no-run`), for a machine without cargo.
# Decode also runs at Kura's default thread count (no --threads): the row "default".
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/.." && pwd)
CORES=$(nproc)
if [ -z "${THREADS:-}" ]; then
    THREADS=""
    for t in 1 2 4 8 12 16 24 32 48 64 96 128; do
        [ "$t" -le "$CORES" ] && THREADS="$THREADS $t"
    done
    case " $THREADS " in *" $CORES "*) ;; *) THREADS="$THREADS $CORES" ;; esac
fi
REPS="${REPS:-3}"
PROMPTS="${PROMPTS:-1024 4096}"
# Decoded tokens a run: past the first trials of another team size (kernels/pace.rs: the first after 64 steps).
export DECODE="${DECODE:-256}"
PEERS="${PEERS:-1}"
MODEL="${MODEL:-$("$REPO/scripts/fetch-model.sh")}"
KURA="${KURA_BIN:-$REPO/target/release/kura}"
if [ -z "${KURA_BIN:-}" ]; then
    (cd "$REPO" && cargo build --release -q -p kura)
fi
for t in $THREADS; do
    case "$t" in '' | *[!0-9]* | 0) echo "threads.sh: THREADS must be counts of at least 1, got '$t'" >&2; exit 2 ;; esac
done
case "$REPS" in '' | *[!0-9]* | 0) echo "threads.sh: REPS must be at least 1, got '$REPS'" >&2; exit 2 ;; esac
case "$DECODE" in '' | *[!0-9]* | 0) echo "threads.sh: DECODE must be at least 1, got '$DECODE'" >&2; exit 2 ;; esac

TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

# Read bandwidth at each thread count, the numerator of the decode bound: measured before, between and
# after the runs, the bound taken from the highest (on a shared machine a neighbour can take a share of
# the memory for minutes; the bound is what the machine gives at its best, so the share is not flattered
# by a measurement taken in a slow moment).
bandwidth() {
    if [ -n "${BANDWIDTH_BIN:-}" ]; then
        KURA_BANDWIDTH_THREADS="$THREADS" "$BANDWIDTH_BIN" --bench 2>/dev/null
    else
        (cd "$REPO" && KURA_BANDWIDTH_THREADS="$THREADS" cargo bench -q -p kura-model --bench bandwidth 2>/dev/null)
    fi
}

echo "# Threads, $(date -u +%Y-%m-%dT%H:%MZ)"
echo
flags=$(grep -m1 '^flags' /proc/cpuinfo)
isa=AVX2
case "$flags" in *avx512f*) isa=AVX-512 ;; esac
echo "Machine: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $CORES cores, $isa;" \
    "Kura kernels: ${KURA_ISA:-as detected}; model $(basename "$MODEL");" \
    "load average before: $(cut -d' ' -f1-3 /proc/loadavg)."
echo
bandwidth >"$TMP/bandwidth-1.txt"

# Prompts of about the asked lengths: the sentence is 10 tokens (joined by spaces).
sentence='The quick brown fox jumps over the lazy dog.'
prompt() { python3 -c "import sys; print(' '.join([sys.argv[1]] * (int(sys.argv[2]) // 10)))" "$sentence" "$1"; }
short=$(prompt 130)
for r in $(seq "$REPS"); do
    "$KURA" generate --model "$MODEL" --prompt "$short" --max-tokens "$DECODE" --ignore-eos \
        --json >"$TMP/kura-default-decode-$r.json" 2>"$TMP/kura-default.log"
    for t in $THREADS; do
        "$KURA" generate --model "$MODEL" --threads "$t" --prompt "$short" --max-tokens "$DECODE" --ignore-eos \
            --json >"$TMP/kura-$t-decode-$r.json" 2>"$TMP/kura.log"
        for p in $PROMPTS; do
            "$KURA" generate --model "$MODEL" --threads "$t" --prompt "$(prompt "$p")" --max-tokens 1 \
                --ignore-eos --json >"$TMP/kura-$t-p$p-$r.json" 2>"$TMP/kura.log"
        done
    done
done

bandwidth >"$TMP/bandwidth-2.txt"

if [ "$PEERS" = 1 ]; then
    BIN="${LLAMA_BIN:-}"
    if [ -z "$BIN" ]; then
        # Kura narrowed to AVX2 is compared with llama.cpp built for AVX2.
        peer_isa=native
        [ "${KURA_ISA:-}" = avx2 ] && peer_isa=avx2
        BIN=$(ISA=$peer_isa "$HERE/peers/build-llama-cpp.sh")
    fi
    tl=$(echo $THREADS | tr ' ' ',')
    pl=$(echo $PROMPTS | tr ' ' ',')
    # llama.cpp's AMX kernels (an extra buffer type) have faulted on machines that report AMX (an illegal
    # instruction where the guest could not use the tiles; a general protection fault on a Xeon where
    # Kura's AMX kernel runs): the run then goes on without its extra buffer types.
    extra=()
    if ! "$BIN/llama-bench" -m "$MODEL" -t 1 -p 8 -n 0 -r 1 >/dev/null 2>&1; then
        extra=(--repack 0)
        echo "llama.cpp ran with \`--repack 0\`: with its extra buffer types (AMX, repacking) it faulted" \
            "on this machine."
        echo
    fi
    "$BIN/llama-bench" -m "$MODEL" -t "$tl" -p "$pl" -n "$DECODE" -r "$REPS" "${extra[@]}" -o json \
        >"$TMP/llama.json" 2>"$TMP/llama.log"
fi

bandwidth >"$TMP/bandwidth-3.txt"

python3 - "$TMP" "$THREADS" "$PROMPTS" "$PEERS" <<'EOF'
import json, os, re, statistics, sys
tmp, threads, prompts, peers = sys.argv[1], sys.argv[2].split(), sys.argv[3].split(), sys.argv[4] == "1"

def kura(t, which, key):
    vals = [json.load(open(os.path.join(tmp, f)))[key] for f in sorted(os.listdir(tmp))
            if f.startswith(f"kura-{t}-{which}-")]
    return statistics.median(vals)

bws = {}
for i in (1, 2, 3):
    for m in re.finditer(r"(\d+) thread\(s\): ([\d.]+) GB/s",
                         open(os.path.join(tmp, f"bandwidth-{i}.txt")).read()):
        bws.setdefault(m.group(1), []).append(float(m.group(2)))
bw = {t: max(v) for t, v in bws.items()}
first = next(f for f in sorted(os.listdir(tmp)) if f.startswith("kura-") and "decode" in f)
per_token = json.load(open(os.path.join(tmp, first)))["weight_bytes_per_token"]
llama = json.load(open(os.path.join(tmp, "llama.json"))) if peers else []

def peer(t, p, n):
    return next((r["avg_ts"] for r in llama if str(r["n_threads"]) == t and r["n_prompt"] == p
                 and r["n_gen"] == n), None)

cols = ["threads", "decode Kura", "llama.cpp", "ratio", "of bound"]
for p in prompts:
    cols += [f"prefill {p} Kura", "llama.cpp", "ratio"]
print("tokens/s (Kura: medians of the runs; llama-bench: means):\n")
print("| " + " | ".join(cols) + " |")
print("|" + "---:|" * len(cols))
fmt = lambda x: "–" if x is None else f"{x:,.0f}"
ratio = lambda a, b: "–" if not b else f"{a / b:.2f}×"
for t in threads:
    d = kura(t, "decode", "decode_tok_per_s")
    ld = peer(t, 0, int(os.environ["DECODE"]))
    bound = bw.get(t, 0) * 1e9 / per_token if t in bw else None
    row = [t, fmt(d), fmt(ld), ratio(d, ld), "–" if not bound else f"{d / bound:.0%}"]
    for p in prompts:
        k = kura(t, f"p{p}", "prompt_tok_per_s")
        lp = peer(t, int(p), 0)
        row += [fmt(k), fmt(lp), ratio(k, lp)]
    print("| " + " | ".join(row) + " |")
dd = kura("default", "decode", "decode_tok_per_s")
best_t = max(threads, key=lambda t: kura(t, "decode", "decode_tok_per_s"))
best = kura(best_t, "decode", "decode_tok_per_s")
threads_line = next((l for l in open(os.path.join(tmp, "kura-default.log")) if "compute threads" in l), "").strip()
chosen = re.search(r"compute threads: (\d+)", threads_line)
chosen = chosen.group(1) if chosen else None
print(f"| default | {fmt(dd)} | | | |" + " | | |" * len(prompts))
print()
print(f"Decode at Kura's default thread count: {dd / best:.0%} of the best count's ({threads_line or 'no log line'}).")
if chosen in threads:
    # The default's count was also measured by name: every run at that count, the default's and the
    # named ones, is a sample of what the default gives (two medians of 3 at one count differ by noise).
    runs = [json.load(open(os.path.join(tmp, f)))["decode_tok_per_s"] for f in sorted(os.listdir(tmp))
            if f.startswith(f"kura-{chosen}-decode-") or f.startswith("kura-default-decode-")]
    pooled = statistics.median(runs)
    print(f"The default chose {chosen} threads (the best count measured: {best_t}); every run at {chosen} "
          f"threads, by default and by name ({len(runs)} runs), has a median of {pooled:,.0f} tokens/s: "
          f"{pooled / best:.0%} of the best count's.")
print()
print(f"Kura reads {per_token / 1e6:.1f} MB of weights per decoded token; read bandwidth (before, between "
      "and after the runs; the bound takes the highest): "
      + ", ".join(f"{t} thread(s) " + " / ".join(f"{x:.1f}" for x in bws[t]) + " GB/s"
                  for t in threads if t in bws) + ".")

def decode_reports(t, key):
    """`key` of each decode run's report at `t` threads, where it has one."""
    runs = [json.load(open(os.path.join(tmp, f))).get(key) for f in sorted(os.listdir(tmp))
            if f.startswith(f"kura-{t}-decode-")]
    return [r for r in runs if r]

# How often the compute threads yielded their core instead of spinning (kernels/seats.rs), in the decode runs.
gave = {t: (statistics.median(r["same_cpu"] for r in runs), statistics.median(r["shared_core"] for r in runs))
        for t in threads if (runs := decode_reports(t, "gave_way"))}
if gave:
    print()
    print("Compute threads that gave their core away in a decode run (medians; to a teammate on the same CPU / "
          "from a core shared with a busy process): "
          + ", ".join(f"{t} thread(s) {a:,.0f} / {b:,.0f}" for t, (a, b) in gave.items()) + ".")
# The team size that decode steps settled on in each run (kernels/pace.rs): the trials' verdicts.
paced = {t: runs for t in threads if (runs := decode_reports(t, "pace"))}
if paced:
    print()
    print("Team size of decode steps at the end of each decode run (trials judged, sizes kept, steps on a "
          "trial's size): "
          + "; ".join(f"{t} thread(s) " + ", ".join(f"{r['size']} ({r['trials']}, {r['changes']}, {r['trial_steps']})"
                                                   for r in runs) for t, runs in paced.items()) + ".")
EOF
