#!/usr/bin/env bash
# On the lent machine: unpacks device-pack/ (scripts/gpu/pack.sh) into gpu-bin/ and device-kit/, and checks
# every file against the digests made when packing. A folder already there (a warm machine keeps ignored
# folders between calls) is kept only where its files match this pack's digests; otherwise, an older build
# or a half-unpacked one, it is removed and unpacked again. Without device-pack/ it does nothing (gpu-bin/
# carried as it is). Uses tar's xz, or Python's where tar has none.
# Usage (from anywhere): scripts/gpu/unpack.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
[ -d device-pack ] || exit 0
matches() { (cd "$1" && sha256sum --quiet --strict -c "../device-pack/$1.sha256" >/dev/null 2>&1); }
for dir in gpu-bin device-kit; do
  pack=device-pack/$dir.tar.xz
  [ -f "$pack" ] || continue
  if [ -d "$dir" ]; then
    if matches "$dir"; then
      echo "unpack.sh: $dir/ is here already and matches $pack" >&2
      continue
    fi
    echo "unpack.sh: $dir/ is here but not $pack's (an older build, or half unpacked): unpacking again" >&2
    rm -rf "$dir"
  fi
  if ! tar xJf "$pack" 2>/dev/null; then
    rm -rf "$dir"
    python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(filter="tar")' "$pack"
  fi
  matches "$dir" || { echo "unpack.sh: $dir/ does not match the digests made when it was packed" >&2; exit 1; }
  echo "unpack.sh: $dir/ unpacked from $pack" >&2
done
