#!/usr/bin/env bash
# Makes sure a C++17 compiler is available for the CPU emulation of Kura's CUDA kernels
# (crates/kura-cuda/emu, `cargo test -p kura-cuda --test emulated`): prints `KURA_CXX=<path>` on stdout,
# for `eval "$(scripts/fetch-cxx.sh)"`. Uses `c++` on PATH if there is one; otherwise installs Debian's
# `g++` package with apt-get (as root, or through sudo without a password).
set -euo pipefail
source "$(dirname "$0")/lib/fetch.sh"

if ! command -v c++ >/dev/null; then
  kura_apt_install fetch-cxx.sh g++
fi
echo "KURA_CXX=$(command -v c++)"
