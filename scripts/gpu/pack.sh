#!/usr/bin/env bash
# Packs what a lent GPU machine runs into device-pack/ (ignored by git; carry it with .whl/): gpu-bin/
# (scripts/gpu-build.sh) and, where it was made, device-kit/ (bench/device/make-kit.sh), each as one
# xz-compressed tar. gpu-bin/ alone is 42 MB, 10 MB packed; the device tool carries 64 MiB of the tree in
# all, which gpu-bin/ and device-kit/ unpacked would pass together. scripts/gpu/unpack.sh (run first by
# scripts/gpu/session.sh and bench/device/run-threads.sh) unpacks them there. Prints what a call carries.
# Usage: scripts/gpu/pack.sh (after scripts/gpu-build.sh, and bench/device/make-kit.sh for the CPU sweep)
set -euo pipefail
cd "$(dirname "$0")/../.."
[ -x gpu-bin/kura ] || { echo "pack.sh: gpu-bin/ is missing: run scripts/gpu-build.sh first" >&2; exit 1; }
rm -rf device-pack
mkdir -p device-pack
for dir in gpu-bin device-kit; do
  [ -d "$dir" ] || { echo "pack.sh: no $dir/ here; not packed" >&2; continue; }
  tar cf - "$dir" | xz -T0 -6 >"device-pack/$dir.tar.xz"
  (cd "$dir" && find . -type f -print0 | sort -z | xargs -0 sha256sum) >"device-pack/$dir.sha256"
done
# What travels besides: the tree (tracked files still there, untracked ones not ignored) and .whl/.
tree=$(git ls-files -z --cached --others --exclude-standard --deduplicate \
  | python3 -c 'import os, sys
print(sum(os.path.getsize(p) for p in sys.stdin.buffer.read().split(b"\0") if p and os.path.isfile(p)))')
[ -d .whl ] || echo "pack.sh: no .whl/ here (scripts/gpu/fetch-wheels.sh): the GPU server check needs it" >&2
packed=$(du -cb device-pack $([ -d .whl ] && echo .whl) | tail -1 | cut -f1)
total=$((tree + packed))
echo "pack.sh: the tree $((tree / 1048576)) MiB + device-pack/ and .whl/ $((packed / 1048576)) MiB = $((total / 1048576)) MiB of the 64 a call carries"
[ "$total" -le $((64 * 1048576)) ] || { echo "pack.sh: over 64 MiB" >&2; exit 1; }
