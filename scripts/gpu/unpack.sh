#!/usr/bin/env bash
# On the lent machine: unpacks device-pack/ (scripts/gpu/pack.sh) into gpu-bin/ and device-kit/ where those
# folders are not there already, and checks every file against the digests made when packing. Without
# device-pack/ it does nothing (gpu-bin/ carried as it is). Uses tar's xz, or Python's where tar has none.
# Usage (from anywhere): scripts/gpu/unpack.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
[ -d device-pack ] || exit 0
for dir in gpu-bin device-kit; do
  pack=device-pack/$dir.tar.xz
  [ -f "$pack" ] || continue
  if [ -d "$dir" ]; then
    echo "unpack.sh: $dir/ is here already; $pack left packed" >&2
    continue
  fi
  if ! tar xJf "$pack" 2>/dev/null; then
    rm -rf "$dir"
    python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(filter="tar")' "$pack"
  fi
  (cd "$dir" && sha256sum --quiet --strict -c "../device-pack/$dir.sha256") \
    || { echo "unpack.sh: $dir/ does not match the digests made when it was packed" >&2; exit 1; }
  echo "unpack.sh: $dir/ unpacked from $pack" >&2
done
