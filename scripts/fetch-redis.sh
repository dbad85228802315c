#!/usr/bin/env bash
# Makes sure Redis 7 is available for the shared KV tier (`kura serve --kv-redis-url`) and its tests:
# prints the path of `redis-server` on stdout. Uses one on PATH if it is version 7 or later; otherwise
# installs Debian's `redis-server` package with apt-get (as root, or through sudo without a password).
# The package's own service is not started: tests and scripts/fleet.sh start their own servers.
set -euo pipefail

version_ok() {
  local v
  v=$("$1" --version 2>/dev/null | sed -n 's/.* v=\([0-9]*\)\..*/\1/p')
  [ -n "$v" ] && [ "$v" -ge 7 ]
}

if command -v redis-server >/dev/null && version_ok "$(command -v redis-server)"; then
  command -v redis-server
  exit 0
fi

if ! command -v apt-get >/dev/null; then
  echo "fetch-redis.sh: redis-server 7+ is not installed and this machine has no apt-get; install Redis 7 and put redis-server on PATH" >&2
  exit 1
fi
if [ "$(id -u)" -eq 0 ]; then
  SUDO=()
elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
  SUDO=(sudo -n)
else
  echo "fetch-redis.sh: installing Debian's redis-server needs root (or passwordless sudo)" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
"${SUDO[@]}" apt-get -qq update >&2
"${SUDO[@]}" apt-get -qq install -y --no-install-recommends redis-server >&2
if ! version_ok "$(command -v redis-server)"; then
  echo "fetch-redis.sh: the installed redis-server is older than 7: $(redis-server --version)" >&2
  exit 1
fi
# Where an init system runs, the package starts its own server on 6379; the project never uses it.
command -v redis-server
