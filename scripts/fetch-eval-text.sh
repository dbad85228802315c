#!/usr/bin/env bash
# Fetches the English prose `kura perplexity` is measured on: two public-domain texts of the Canterbury
# corpus, Lewis Carroll's "Alice's Adventures in Wonderland" (alice29.txt, Project Gutenberg) and the
# Library of Congress "Workshop on Electronic Texts" proceedings of 1992 (lcet10.txt, Project Gutenberg;
# a work of the US government), about 131,000 tokens together for SmolLM2's tokenizer. Both ship as test
# data in the source distribution of the PyPI package Brotli==1.1.0 (MIT); the archive and each text are
# checked against sha256 sums. Prints the path of the joined text (alice29 then lcet10) on stdout.
# Idempotent: a verified file already in the cache is reused.
set -euo pipefail

ARCHIVE_SHA256=81de08ac11bcb85841e440c13611c00b67d3bf82698314928d0b676362546724
ALICE_SHA256=7467306ee0feed4971260f3c87421154a05be571d944e9cb021a5713700c38f0
LCET_SHA256=5314ba1dbb03f471df88bec6cd120a938ef60d0fd3511c5c1dce61bf7463245f
TEXT_SHA256=2464baea9ddbc55ceec1a31f25b03752b57226db104f569ad487781a4c395959
CACHE="${KURA_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/kura}/text"
DEST="$CACHE/canterbury-alice29-lcet10.txt"

check() { echo "$1  $2" | sha256sum --check --status; }

if [ -f "$DEST" ] && check "$TEXT_SHA256" "$DEST"; then
  echo "$DEST"
  exit 0
fi

mkdir -p "$CACHE"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
PY=$(command -v python3 || command -v python)
# The source archive only: pip reads its metadata, nothing is built or installed.
"$PY" -m pip download --quiet --no-deps --no-binary :all: --disable-pip-version-check \
  Brotli==1.1.0 -d "$tmp" >&2
archive="$tmp/Brotli-1.1.0.tar.gz"
if ! check "$ARCHIVE_SHA256" "$archive"; then
  echo "fetch-eval-text: Brotli-1.1.0.tar.gz does not match sha256 $ARCHIVE_SHA256; refusing to use it" >&2
  exit 1
fi
tar -xzf "$archive" -C "$tmp" Brotli-1.1.0/tests/testdata/alice29.txt Brotli-1.1.0/tests/testdata/lcet10.txt
data="$tmp/Brotli-1.1.0/tests/testdata"
check "$ALICE_SHA256" "$data/alice29.txt" || { echo "fetch-eval-text: alice29.txt does not match its sha256" >&2; exit 1; }
check "$LCET_SHA256" "$data/lcet10.txt" || { echo "fetch-eval-text: lcet10.txt does not match its sha256" >&2; exit 1; }
cat "$data/alice29.txt" "$data/lcet10.txt" > "$tmp/text.txt"
check "$TEXT_SHA256" "$tmp/text.txt" || { echo "fetch-eval-text: the joined text does not match sha256 $TEXT_SHA256" >&2; exit 1; }
mv "$tmp/text.txt" "$DEST"
echo "$DEST"
