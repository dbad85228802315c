# shellcheck shell=bash
# Sourced by the GPU session's scripts (scripts/gpu/session.sh, all.sh, tiers.sh): `bounded LIMIT
# COMMAND...` runs COMMAND under `timeout -k 5 LIMIT` in a process group of its own (timeout makes
# itself its leader), waits for it and returns its exit status (124: over LIMIT).
# coreutils' timeout sends its TERM to the whole group at the limit, but returns as soon as COMMAND
# itself has ended: the KILL after -k never reaches what COMMAND left behind (a `kura serve` ending
# gracefully on the TERM, still holding GPU memory when the next step starts). So after the step,
# whatever is left of its group gets 5 s to end (and a TERM first where the step ended on its own,
# before its limit), and is then killed: a step takes at most LIMIT + 10 s, and the killed processes'
# end is awaited (2 s at most; a zombie counts as ended). A TERM or INT to the sourcing script goes on to the running step's
# group the same way, and the script then exits 143.
_bounded_step=""
# This script's own process group, which is never signalled: the fields after the command's name in
# /proc/PID/stat are the state, the parent and the group.
_bounded_own=$(sed 's/.*) //' "/proc/$$/stat" 2>/dev/null | cut -d' ' -f3)

# Whether process group $1 has a process that has not ended: a zombie (ended, not yet reaped by its
# parent, init where the step has gone) counts as ended.
_bounded_live() {
  local f line a
  kill -0 -- "-$1" 2>/dev/null || return 1
  for f in /proc/[0-9]*/stat; do
    read -r line <"$f" 2>/dev/null || continue
    read -r -a a <<<"${line##*) }"
    [ "${a[2]:-}" != "$1" ] || [ "${a[0]:-}" = Z ] || return 0
  done
  return 1
}

# Ends what is left of process group $1 (a step's, ended): a TERM where $2 is `term` (the group has
# had none), up to 5 s, then KILL. Never this script's own group.
_bounded_reap() {
  local group=$1 i
  case "$group" in '' | *[!0-9]* | 0 | 1) return 0 ;; esac
  if [ "$group" = "$$" ] || [ "$group" = "${_bounded_own:-$$}" ]; then return 0; fi
  _bounded_live "$group" || return 0
  [ "${2:-}" != term ] || kill -TERM -- "-$group" 2>/dev/null
  for i in $(seq 50); do
    _bounded_live "$group" || return 0
    sleep 0.1
  done
  echo "bounded: the step's process group $group outlasted it by 5 s: killed" >&2
  kill -KILL -- "-$group" 2>/dev/null
  for i in $(seq 20); do
    _bounded_live "$group" || return 0
    sleep 0.1
  done
  return 0
}

bounded() {
  local limit=$1 rc group
  shift
  timeout -k 5 "$limit" "$@" &
  _bounded_step=$!
  group=$_bounded_step
  wait "$_bounded_step"
  rc=$?
  # Cleared at once: a late TERM must not reach a process that reused the pid.
  _bounded_step=""
  # 124: the limit's TERM went to the group already.
  _bounded_reap "$group" "$([ "$rc" -eq 124 ] || echo term)"
  return "$rc"
}

_bounded_stop() {
  local group=$_bounded_step
  if [ -n "$group" ]; then
    kill -TERM "$group" 2>/dev/null
    wait "$group" 2>/dev/null
    _bounded_step=""
    _bounded_reap "$group"
  fi
}
trap '_bounded_stop; exit 143' TERM INT
