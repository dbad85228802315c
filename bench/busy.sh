#!/usr/bin/env bash
# Batch-1 decode beside busy processes: Kura (and llama.cpp, on the same model file) quiet, beside one
# busy process pinned to the last CPU ("one busy core"), beside one busy process per CPU ("every core
# busy": the scheduler places them, and may put two on one core), and beside one busy process pinned to
# each CPU ("every core busy, pinned": each core shared by one), the modes interleaved run by run so
# that a neighbour's load falls on all of them alike.
# Each run decodes 128 tokens after a ~130-token prompt (`kura generate --ignore-eos --json`,
# `llama-bench -p 0 -n 128 -r 1`). Prints tokens/s, medians of REPS runs with their ranges, and each
# mode's slowdown against quiet.
#
# Usage: bench/busy.sh
# Environment: THREADS [the CPUs this process may use]  REPS [5]  MODES ["quiet one all pinned"]
#   MODEL [scripts/fetch-model.sh]  KURA_BIN [target/release/kura, built here]  BASE_BIN (a second Kura
#   binary measured in the same runs, e.g. an older build)  PEERS [1] (0: Kura only; llama.cpp from
#   bench/peers/build-llama-cpp.sh, or LLAMA_BIN: a directory holding llama-bench)
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/.." && pwd)
CPUS=$(nproc)
THREADS="${THREADS:-$CPUS}"
REPS="${REPS:-5}"
MODES="${MODES:-quiet one all pinned}"
PEERS="${PEERS:-1}"
case "$THREADS" in '' | *[!0-9]* | 0) echo "busy.sh: THREADS must be a count of at least 1, got '$THREADS'" >&2; exit 2 ;; esac
case "$REPS" in '' | *[!0-9]* | 0) echo "busy.sh: REPS must be at least 1, got '$REPS'" >&2; exit 2 ;; esac
for m in $MODES; do
    case "$m" in quiet | one | all | pinned) ;; *) echo "busy.sh: MODES are quiet, one, all and pinned, got '$m'" >&2; exit 2 ;; esac
done
MODEL="${MODEL:-$("$REPO/scripts/fetch-model.sh")}"
KURA="${KURA_BIN:-$REPO/target/release/kura}"
if [ -z "${KURA_BIN:-}" ]; then
    (cd "$REPO" && cargo build --release -q -p kura)
fi
[ -x "$KURA" ] || { echo "busy.sh: $KURA is not an executable" >&2; exit 1; }
if [ -n "${BASE_BIN:-}" ] && [ ! -x "$BASE_BIN" ]; then
    echo "busy.sh: BASE_BIN $BASE_BIN is not an executable" >&2
    exit 1
fi
LLAMA=""
if [ "$PEERS" != 0 ]; then
    LLAMA="${LLAMA_BIN:-$("$HERE/peers/build-llama-cpp.sh")}/llama-bench"
    [ -x "$LLAMA" ] || { echo "busy.sh: no llama-bench at $LLAMA" >&2; exit 1; }
    # As in threads.sh: where llama.cpp's extra buffer types (AMX, repacking) fault, run without them.
    if ! "$LLAMA" -m "$MODEL" -t 1 -p 8 -n 0 -r 1 >/dev/null 2>&1; then
        LLAMA_EXTRA="--repack 0"
        echo "llama.cpp runs with \`--repack 0\`: with its extra buffer types it faulted on this machine."
        echo
    fi
fi

exec python3 - "$KURA" "${BASE_BIN:-}" "$LLAMA" "${LLAMA_EXTRA:-}" "$MODEL" "$THREADS" "$REPS" "$CPUS" \
    $MODES <<'EOF'
import json, os, statistics, subprocess, sys, time

kura, base, llama, llama_extra, model, threads, reps, cpus = sys.argv[1:9]
modes = sys.argv[9:]
threads, reps, cpus = int(threads), int(reps), int(cpus)
prompt = " ".join(["The quick brown fox jumps over the lazy dog."] * 13)

def kura_run(binary):
    out = subprocess.run(
        [binary, "generate", "--model", model, "--threads", str(threads), "--prompt", prompt,
         "--max-tokens", "128", "--ignore-eos", "--json"],
        capture_output=True, text=True, check=True)
    return json.loads(out.stdout)["decode_tok_per_s"]

def llama_run():
    out = subprocess.run(
        [llama, "-m", model, "-t", str(threads), "-p", "0", "-n", "128", "-r", "1", "-o", "json"]
        + llama_extra.split(),
        capture_output=True, text=True, check=True)
    return json.loads(out.stdout)[0]["avg_ts"]

engines = [("Kura", lambda: kura_run(kura))]
if base:
    engines.append(("Kura (BASE_BIN)", lambda: kura_run(base)))
if llama:
    engines.append(("llama.cpp", llama_run))

# The CPUs this process may run on (a container's cpuset need not start at 0).
allowed = sorted(os.sched_getaffinity(0))

def hogs(mode):
    if mode == "one":
        return [subprocess.Popen(["taskset", "-c", str(allowed[-1]), "yes"], stdout=subprocess.DEVNULL)]
    if mode == "all":
        return [subprocess.Popen(["yes"], stdout=subprocess.DEVNULL) for _ in range(cpus)]
    if mode == "pinned":
        return [subprocess.Popen(["taskset", "-c", str(c), "yes"], stdout=subprocess.DEVNULL)
                for c in allowed]
    return []

runs = {}
for _ in range(reps):
    for mode in modes:
        busy = hogs(mode)
        try:
            time.sleep(0.3 if busy else 0)
            for name, run in engines:
                runs.setdefault((name, mode), []).append(run())
        finally:
            for h in busy:
                h.kill()
                h.wait()

names = {"quiet": "quiet", "one": "one busy core", "all": "every core busy",
         "pinned": "every core busy, pinned"}
print(f"# Decode beside busy processes, {time.strftime('%Y-%m-%dT%H:%MZ', time.gmtime())}\n")
print(f"{threads} threads on {cpus} CPUs, batch-1 decode of 128 tokens, tokens/s: medians of {reps} "
      "(ranges); slowdown against the same engine quiet\n")
print("| engine | " + " | ".join(names[m] for m in modes) + " |")
print("|---|" + "---:|" * len(modes))
for name, _ in engines:
    cells = []
    quiet = statistics.median(runs[(name, "quiet")]) if "quiet" in modes else None
    for m in modes:
        v = runs[(name, m)]
        med = statistics.median(v)
        cell = f"{med:,.1f} ({min(v):,.0f}–{max(v):,.0f})"
        if quiet and m != "quiet":
            cell += f", {quiet / med:.2f}×"
        cells.append(cell)
    print(f"| {name} | " + " | ".join(cells) + " |")
EOF
