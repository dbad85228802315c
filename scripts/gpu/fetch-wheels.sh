#!/usr/bin/env bash
# Downloads the official `openai` client and the packages it needs that the GPU machine's image lacks,
# as wheels for its Python (3.12, x86-64 manylinux), into .whl/ (git-ignored), which travels to the GPU
# machine beside gpu-bin/; scripts/test-gpu.sh installs them there without a network.
# Usage: scripts/gpu/fetch-wheels.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .whl
plats=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  plats+=(--platform "$p")
done
# Every version pinned: .whl/ keeps what earlier runs fetched, and two versions of one package there stop
# the whole install on the GPU machine.
for req in openai==2.54.0 pydantic==2.14.4 pydantic-core==2.50.5 jiter==0.19.0 distro==1.9.0 sniffio==1.3.1 \
  annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${plats[@]}" -d .whl "$req"
done
ls .whl
