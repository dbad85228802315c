#!/usr/bin/env bash
# Builds the stand-in NVIDIA driver and cuBLAS (driver.cpp + kernels.cpp, cublas.cpp) into OUT_DIR as
# libcuda.so and libcublas.so, for running Kura's CUDA executor on the CPU: a process that loads them (by
# path, before cudarc looks for the real ones, or through LD_LIBRARY_PATH=OUT_DIR) runs `--device cuda`
# with the kernels emulated (emu.h). Needs a C++17 compiler ($KURA_CXX, else c++; scripts/fetch-cxx.sh)
# and cuda.h ($KURA_CUDA_INCLUDE; scripts/fetch-nvrtc.sh).
# Usage: crates/kura-cuda/emu/build.sh OUT_DIR
set -euo pipefail
[ $# -eq 1 ] || { echo "usage: $0 OUT_DIR" >&2; exit 2; }
here=$(cd "$(dirname "$0")" && pwd)
out=$1
cxx=${KURA_CXX:-c++}
include=${KURA_CUDA_INCLUDE:?KURA_CUDA_INCLUDE names the folder holding cuda.h (scripts/fetch-nvrtc.sh prints it)}
[ -f "$include/cuda.h" ] || { echo "$include holds no cuda.h (scripts/fetch-nvrtc.sh fetches it)" >&2; exit 1; }
command -v "$cxx" >/dev/null || { echo "no C++ compiler $cxx: run scripts/fetch-cxx.sh, or set KURA_CXX" >&2; exit 1; }
mkdir -p "$out"
# -ffp-contract=off: one rounding per written operation, as the kernels' claims are checked (emu.h).
flags=(-std=c++17 -O2 -fPIC -fno-semantic-interposition -shared -ffp-contract=off -fno-strict-aliasing -Wall -Werror -Wno-unknown-pragmas
  -Wno-sign-compare -Wno-unused-variable)
# Built under temporary names and renamed: a process that loads the folder never sees half a library.
"$cxx" "${flags[@]}" -I"$include" -Wl,-soname,libcuda.so -o "$out/libcuda.so.$$" "$here/driver.cpp" "$here/kernels.cpp"
mv "$out/libcuda.so.$$" "$out/libcuda.so"
"$cxx" "${flags[@]}" -Wl,-soname,libcublas.so -o "$out/libcublas.so.$$" "$here/cublas.cpp" -L"$out" -lcuda
mv "$out/libcublas.so.$$" "$out/libcublas.so"
