# shellcheck shell=bash
# Sourced by the GPU scripts on a machine with an NVIDIA GPU: puts CUDA's libraries (NVRTC, cuBLAS) on
# the library path for cudarc's run-time loading and points KURA_CUDA_INCLUDE at the toolkit's headers.
# Never adds CUDA's lib/stubs folder: its libcuda is a stub (CUDA_ERROR_STUB_LIBRARY); the driver's
# libcuda is found by ldconfig. The scripts that source it run under `set -euo pipefail`: a search that
# finds nothing must not end them silently (the error then comes from Kura, naming what is missing).
if ! nvidia-smi -L >/dev/null 2>&1; then
  echo "no NVIDIA GPU here (nvidia-smi finds none): the GPU tests and benchmarks need one" >&2
  exit 1
fi
_kura_libs=$(find /usr/local /opt -name 'libnvrtc.so*' -o -name 'libcublas.so*' -o -name 'libcublasLt.so*' 2>/dev/null \
  | xargs -r -n1 dirname | { grep -v stubs || true; } | sort -u | tr '\n' ':' || true)
export LD_LIBRARY_PATH="${_kura_libs}${LD_LIBRARY_PATH:-}"
if [ -z "${KURA_CUDA_INCLUDE:-}" ]; then
  _kura_inc=$(find /usr/local/cuda*/targets/*/include /usr/local/cuda/include -maxdepth 1 -name cuda_bf16.h 2>/dev/null | head -1 || true)
  if [ -n "$_kura_inc" ]; then
    KURA_CUDA_INCLUDE=$(dirname "$_kura_inc")
    export KURA_CUDA_INCLUDE
  fi
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
