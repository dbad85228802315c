#!/usr/bin/env bash
# Makes sure headless Chromium and its driver are available for the console's browser tests
# (tests/python/test_console.py): prints `KURA_CHROMIUM=…` and `KURA_CHROMEDRIVER=…` lines for `eval`.
# Uses `chromium` and `chromedriver` on PATH when both are there; otherwise installs Debian's `chromium`
# and `chromium-driver` packages with apt-get (as root, or through sudo without a password).
set -euo pipefail
source "$(dirname "$0")/lib/fetch.sh"

found() {
  command -v chromium >/dev/null && command -v chromedriver >/dev/null
}

if ! found; then
  kura_apt_install fetch-chromium.sh chromium chromium-driver
fi
if ! found; then
  echo "fetch-chromium.sh: chromium or chromedriver is still missing after installing them" >&2
  exit 1
fi
echo "KURA_CHROMIUM=$(command -v chromium)"
echo "KURA_CHROMEDRIVER=$(command -v chromedriver)"
