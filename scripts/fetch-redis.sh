#!/usr/bin/env bash
# Makes sure Redis 7 is available for the shared KV tier (`kura serve --kv-redis-url`) and its tests:
# prints the path of `redis-server` on stdout. The `rediss://` tests also need the `openssl` command (to
# make a test CA and certificate), installed here too when missing. Uses one on PATH if it is version 7 or later; otherwise
# installs Debian's `redis-server` package with apt-get (as root, or through sudo without a password).
# The package's own service is not started: tests and scripts/fleet.sh start their own servers.
set -euo pipefail
source "$(dirname "$0")/lib/fetch.sh"

version_ok() {
  local v
  v=$("$1" --version 2>/dev/null | sed -n 's/.* v=\([0-9]*\)\..*/\1/p')
  [ -n "$v" ] && [ "$v" -ge 7 ]
}

if command -v redis-server >/dev/null && version_ok "$(command -v redis-server)" \
  && command -v openssl >/dev/null; then
  command -v redis-server
  exit 0
fi

kura_apt_install fetch-redis.sh redis-server openssl
if ! version_ok "$(command -v redis-server)"; then
  echo "fetch-redis.sh: the installed redis-server is older than 7: $(redis-server --version)" >&2
  exit 1
fi
# Where an init system runs, the package starts its own server on 6379; the project never uses it.
command -v redis-server
