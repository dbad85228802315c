#!/usr/bin/env bash
# Runs all of Kura's tests: the Rust workspace (unit, property, scenario and real-model tests) and the
# Python tests that drive `kura serve` with the official `openai` client. Installs what they need: the
# default model (scripts/fetch-model.sh), Gemma 3 270M for the Gemma 3 tests (scripts/fetch-gemma.sh),
# llama.cpp's tokenizer conformance files (scripts/fetch-vocab-tests.sh), the text `kura perplexity` is
# tested on (scripts/fetch-eval-text.sh), Redis 7 for the shared KV tier (scripts/fetch-redis.sh: Debian's
# redis-server), NVRTC and the CUDA headers from PyPI so that every GPU kernel compiles here without a GPU
# (scripts/fetch-nvrtc.sh; the GPU tests themselves are scripts/test-gpu.sh), a C++ compiler that runs the
# kernels on the CPU in an emulation (scripts/fetch-cxx.sh: Debian's g++), Debian's Chromium and
# ChromeDriver for the console's browser tests (scripts/fetch-chromium.sh) and a Python virtual
# environment with tests/python/requirements.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/check-links.sh  # docs first (fast): README.md and docs/ links and anchors resolve; README.md <= 200 lines
# The crate graph equals docs/ARCHITECTURE.md's table, no crate declares a dependency it does not use, and the
# router, bench and simulator stay off the model runtime.
python3 scripts/check-crates.py

KURA_MODEL=$(scripts/fetch-model.sh)
export KURA_MODEL
KURA_GEMMA_MODEL=$(scripts/fetch-gemma.sh)
export KURA_GEMMA_MODEL
KURA_VOCAB_DIR=$(scripts/fetch-vocab-tests.sh)
export KURA_VOCAB_DIR
KURA_EVAL_TEXT=$(scripts/fetch-eval-text.sh)
export KURA_EVAL_TEXT
KURA_REDIS_SERVER=$(scripts/fetch-redis.sh)
export KURA_REDIS_SERVER
# KURA_NVRTC_LIB, KURA_CUDA_INCLUDE and KURA_NVDISASM, for kura-cuda's kernel compile tests.
nvrtc_env=$(scripts/fetch-nvrtc.sh)
eval "$nvrtc_env"
export KURA_NVRTC_LIB KURA_CUDA_INCLUDE KURA_NVDISASM
# KURA_CXX, for the CPU emulation of the CUDA kernels (crates/kura-cuda/emu).
cxx_env=$(scripts/fetch-cxx.sh)
eval "$cxx_env"
export KURA_CXX
# KURA_CHROMIUM and KURA_CHROMEDRIVER, for the console's browser tests.
chromium_env=$(scripts/fetch-chromium.sh)
eval "$chromium_env"
export KURA_CHROMIUM KURA_CHROMEDRIVER

# No incremental state: a fresh build gains nothing from it, and it costs disk (about 150 MB for
# kura-server's test build alone; a CI machine once ran out of disk while linking). CARGO_INCREMENTAL=1
# keeps it.
export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"

# Plain `cargo test`: the dev and test profiles are optimised (Cargo.toml) but keep debug assertions and
# overflow checks in Kura's crates (kura-model's kernels and the dependencies aside, which build as in a
# release), so kura-kv's `debug_assert!`s and every unchecked size would fail here. The server the
# Python tests start is the same build: `cargo test` builds target/debug/kura for the `kura` crate's own
# tests, with the workspace's features. (A `cargo build -p kura` would resolve the features of that crate
# alone and compile many dependencies a second time.)
started=$SECONDS
cargo test --workspace --no-run
# kura-cuda's emulated executor (its kernels run on the CPU one thread at a time: one core, minutes) runs
# beside the rest of the workspace's tests, which skip its tests by name. The same package selection as
# the run below, so the same build. The names are skipped exactly, in every binary: a test elsewhere of
# the same name would be skipped too (tests/gpu.rs shares one, a GPU test that cargo test ignores).
emulated=$(cargo test --workspace --test emulated_executor --no-run --message-format=json |
  python3 -c 'import json, sys
exes = [m["executable"] for m in map(json.loads, sys.stdin)
        if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "emulated_executor"
        and m.get("executable")]
assert len(exes) == 1, f"expected one emulated_executor test binary, got {exes}"
print(exes[0])')
skips=()
while read -r name; do
  skips+=(--skip "$name")
done < <("$emulated" --list --format terse | sed -n 's/: test$//p')
if [ "${#skips[@]}" -eq 0 ]; then
  echo "test.sh: $emulated lists no tests" >&2
  exit 1
fi
emulated_log=$(mktemp)
# As cargo runs a test binary: from its package's folder.
(cd crates/kura-cuda && exec "$emulated") >"$emulated_log" 2>&1 &
emulated_pid=$!
rust_rc=0
cargo test --workspace -- --exact "${skips[@]}" || rust_rc=$?
emulated_rc=0
wait "$emulated_pid" || emulated_rc=$?
echo "test.sh: kura-cuda's emulated executor tests ($emulated):" >&2
cat "$emulated_log" >&2
rm -f "$emulated_log"
if [ "$rust_rc" -ne 0 ] || [ "$emulated_rc" -ne 0 ]; then
  echo "test.sh: Rust tests failed (workspace exit $rust_rc, emulated executor exit $emulated_rc)" >&2
  exit 1
fi
echo "test.sh: Rust build and tests took $((SECONDS - started)) s" >&2

if [ -f tests/python/requirements.txt ] && ls tests/python/test_*.py >/dev/null 2>&1; then
  venv="${KURA_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/kura}/venv-test"
  if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
  fi
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -r tests/python/requirements.txt
  if [ ! -x target/debug/kura ]; then
    echo "test.sh: cargo test did not build target/debug/kura" >&2
    exit 1
  fi
  started=$SECONDS
  # --durations: the slowest tests in the log, where the suite's time goes.
  KURA_BIN="$PWD/target/debug/kura" "$venv/bin/python" -m pytest -q --durations=15 tests/python
  echo "test.sh: Python tests took $((SECONDS - started)) s" >&2
fi
