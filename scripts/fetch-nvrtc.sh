#!/usr/bin/env bash
# Fetches NVIDIA's run-time CUDA compiler, NVRTC 13.0, and the CUDA headers kernels include (cuda_bf16.h,
# cuda_fp16.h, mma.h, cuda_pipeline.h, crt/…) from PyPI, so that a machine without a CUDA toolkit (or a
# GPU) can compile CUDA C kernels at run time, and nvdisasm, which prints the machine code a compile made
# (the kernel tests read it). The wheels nvidia-cuda-nvrtc, nvidia-cuda-runtime, nvidia-cuda-crt and
# nvidia-cuda-nvdisasm (manylinux x86_64) are pinned by file name and sha256 and unpacked, without pip
# install, into $(kura_cache_root)/nvrtc-13.0: lib/ (libnvrtc.so.13, libnvrtc.so,
# libnvrtc-builtins.so.13.0), include/ and bin/nvdisasm. Prints `KURA_NVRTC_LIB=<lib dir>`,
# `KURA_CUDA_INCLUDE=<include dir>` and `KURA_NVDISASM=<nvdisasm>` on stdout, for
# `eval "$(scripts/fetch-nvrtc.sh)"`. Idempotent: a complete install of the same wheels is reused.
#
# Licence: the files are distributed under NVIDIA's CUDA Toolkit EULA (the wheels' License.txt), not
# Apache-2.0; by fetching them you accept its terms.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib/fetch.sh"

# One wheel a line: its file name and sha256.
PINS="nvidia_cuda_nvrtc-13.0.88-py3-none-manylinux2010_x86_64.manylinux_2_12_x86_64.whl ad9b6d2ead2435f11cbb6868809d2adeeee302e9bb94bcf0539c7a40d80e8575
nvidia_cuda_runtime-13.0.96-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl 7f82250d7782aa23b6cfe765ecc7db554bd3c2870c43f3d1821f1d18aebf0548
nvidia_cuda_crt-13.0.88-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl 2c8043c7c9e02492716426e9919fc78d2c5b3b2a7a768a88e952676b08aa55a4
nvidia_cuda_nvdisasm-13.2.86-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl 53606e719ecae07a2335f95902d5a1393a0cc1c317499ee7ffcf628a44385f2c"
DEST="$(kura_cache_root)/nvrtc-13.0"
MARKER="$DEST/.fetched" # holds $PINS, written last: its presence means the unpacking finished

print_paths() {
  local dir
  dir=$(cd "$DEST" && pwd -P)
  printf 'KURA_NVRTC_LIB=%q\nKURA_CUDA_INCLUDE=%q\nKURA_NVDISASM=%q\n' "$dir/lib" "$dir/include" "$dir/bin/nvdisasm"
}

if [ "$(cat "$MARKER" 2>/dev/null)" = "$PINS" ]; then
  print_paths
  exit 0
fi

[ "$(uname -s)/$(uname -m)" = Linux/x86_64 ] || kura_die "fetch-nvrtc: the pinned wheels are for Linux x86_64 only"
kura_tmpdir
tmp=$KURA_TMP
kura_python
reqs=()
while read -r whl _; do
  req=${whl%%-py3-*} # nvidia_cuda_nvrtc-13.0.88-py3-… → nvidia_cuda_nvrtc==13.0.88
  reqs+=("${req/-/==}")
done <<<"$PINS"
kura_pip_download "$tmp" --only-binary=:all: --platform manylinux_2_12_x86_64 \
  --platform manylinux_2_17_x86_64 "${reqs[@]}"
while read -r whl sha256; do
  kura_require "fetch-nvrtc: $whl is missing or does not match sha256 $sha256; refusing to use it" \
    "$tmp/$whl" "$sha256"
done <<<"$PINS"

echo "fetch-nvrtc: unpacking into $DEST" >&2
rm -rf "$DEST"
mkdir -p "$DEST/lib" "$DEST/include" "$DEST/bin"
"$PY" - "$DEST" "$tmp"/*.whl <<'PYEOF'
import sys, os, shutil, zipfile
dest, wheels = sys.argv[1], sys.argv[2:]
libs = {"nvidia/cu13/lib/libnvrtc.so.13", "nvidia/cu13/lib/libnvrtc-builtins.so.13.0"}
for whl in wheels:
    with zipfile.ZipFile(whl) as z:
        for m in z.infolist():
            if m.filename in libs:
                out = os.path.join(dest, "lib", os.path.basename(m.filename))
            elif m.filename == "nvidia/cu13/bin/nvdisasm":
                out = os.path.join(dest, "bin", "nvdisasm")
            elif m.filename.startswith("nvidia/cu13/include/") and not m.is_dir():
                out = os.path.join(dest, "include", m.filename[len("nvidia/cu13/include/"):])
            else:
                continue
            os.makedirs(os.path.dirname(out), exist_ok=True)
            with z.open(m) as src, open(out, "wb") as dst:
                shutil.copyfileobj(src, dst)
            os.chmod(out, 0o755 if out.endswith((".so.13", ".so.13.0", "/nvdisasm")) else 0o644)
PYEOF
for f in lib/libnvrtc.so.13 lib/libnvrtc-builtins.so.13.0 include/nvrtc.h include/cuda_bf16.h include/crt/mma.h bin/nvdisasm; do
  [ -f "$DEST/$f" ] || kura_die "fetch-nvrtc: $f is missing from the unpacked wheels"
done
ln -sfn libnvrtc.so.13 "$DEST/lib/libnvrtc.so"
echo "$PINS" >"$MARKER"
print_paths
