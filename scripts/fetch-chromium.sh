#!/usr/bin/env bash
# Makes sure headless Chromium and its driver are available for the console's browser tests
# (tests/python/test_console.py): prints `KURA_CHROMIUM=…` and `KURA_CHROMEDRIVER=…` lines for `eval`.
# Uses `chromium` and `chromedriver` on PATH when both are there; otherwise installs Debian's `chromium`
# and `chromium-driver` packages with apt-get (as root, or through sudo without a password).
set -euo pipefail

found() {
  command -v chromium >/dev/null && command -v chromedriver >/dev/null
}

if ! found; then
  if ! command -v apt-get >/dev/null; then
    echo "fetch-chromium.sh: chromium and chromedriver are not installed and this machine has no apt-get; install them and put them on PATH" >&2
    exit 1
  fi
  if [ "$(id -u)" -eq 0 ]; then
    SUDO=()
  elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
    SUDO=(sudo -n)
  else
    echo "fetch-chromium.sh: installing Debian's chromium and chromium-driver needs root (or passwordless sudo)" >&2
    exit 1
  fi
  export DEBIAN_FRONTEND=noninteractive
  "${SUDO[@]}" apt-get -qq update >&2
  "${SUDO[@]}" apt-get -qq install -y --no-install-recommends chromium chromium-driver >&2
fi
if ! found; then
  echo "fetch-chromium.sh: chromium or chromedriver is still missing after installing them" >&2
  exit 1
fi
echo "KURA_CHROMIUM=$(command -v chromium)"
echo "KURA_CHROMEDRIVER=$(command -v chromedriver)"
