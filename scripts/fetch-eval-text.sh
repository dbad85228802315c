#!/usr/bin/env bash
# Fetches the English prose `kura perplexity` is measured on: two public-domain texts of the Canterbury
# corpus, Lewis Carroll's "Alice's Adventures in Wonderland" (alice29.txt, Project Gutenberg) and the
# Library of Congress "Workshop on Electronic Texts" proceedings of 1992 (lcet10.txt, Project Gutenberg;
# a work of the US government), about 131,000 tokens together for SmolLM2's tokenizer. Both ship as test
# data in the source distribution of the PyPI package Brotli==1.1.0 (MIT); the archive and each text are
# checked against sha256 sums. Prints the path of the joined text (alice29 then lcet10) on stdout.
# Idempotent: a verified file already in the cache is reused.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib/fetch.sh"

ARCHIVE_SHA256=81de08ac11bcb85841e440c13611c00b67d3bf82698314928d0b676362546724
ALICE_SHA256=7467306ee0feed4971260f3c87421154a05be571d944e9cb021a5713700c38f0
LCET_SHA256=5314ba1dbb03f471df88bec6cd120a938ef60d0fd3511c5c1dce61bf7463245f
TEXT_SHA256=2464baea9ddbc55ceec1a31f25b03752b57226db104f569ad487781a4c395959
CACHE="$(kura_cache_root)/text"
DEST="$CACHE/canterbury-alice29-lcet10.txt"

if kura_verify "$DEST" "$TEXT_SHA256"; then
  echo "$DEST"
  exit 0
fi

mkdir -p "$CACHE"
kura_tmpdir
tmp=$KURA_TMP
kura_python
# The source archive only: pip reads its metadata, nothing is built or installed.
kura_pip_download "$tmp" --no-binary :all: Brotli==1.1.0
archive="$tmp/Brotli-1.1.0.tar.gz"
kura_require "fetch-eval-text: Brotli-1.1.0.tar.gz does not match sha256 $ARCHIVE_SHA256; refusing to use it" \
  "$archive" "$ARCHIVE_SHA256"
tar -xzf "$archive" -C "$tmp" Brotli-1.1.0/tests/testdata/alice29.txt Brotli-1.1.0/tests/testdata/lcet10.txt
data="$tmp/Brotli-1.1.0/tests/testdata"
kura_require "fetch-eval-text: alice29.txt does not match its sha256" "$data/alice29.txt" "$ALICE_SHA256"
kura_require "fetch-eval-text: lcet10.txt does not match its sha256" "$data/lcet10.txt" "$LCET_SHA256"
cat "$data/alice29.txt" "$data/lcet10.txt" > "$tmp/text.txt"
kura_require "fetch-eval-text: the joined text does not match sha256 $TEXT_SHA256" "$tmp/text.txt" "$TEXT_SHA256"
kura_install "$tmp/text.txt" "$DEST"
echo "$DEST"
