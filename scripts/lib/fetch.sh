# Shared by the scripts/fetch-*.sh scripts, which source it (`source "$(dirname "$0")/lib/fetch.sh"`):
# the cache folder, the temporary folder a download goes to, pip downloads, the size and sha256 check,
# the refusal and the move into the cache, and Debian packages with apt-get. Messages go to stderr;
# stdout is left to the script, which prints the path it fetched and nothing else.

# The cache outside the repository: $KURA_CACHE_DIR, else $XDG_CACHE_HOME/kura, else ~/.cache/kura.
kura_cache_root() {
  echo "${KURA_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/kura}"
}

# kura_verify FILE SHA256 [SIZE]: succeeds when FILE is a regular file of SIZE bytes (when SIZE is
# given) whose sha256 is SHA256. Prints nothing.
kura_verify() {
  local file=$1 sha256=$2 size=${3:-}
  [ -f "$file" ] || return 1
  if [ -n "$size" ] && [ "$(stat -c %s "$file")" != "$size" ]; then
    return 1
  fi
  echo "$sha256  $file" | sha256sum --check --status
}

# kura_die MESSAGE: prints MESSAGE on stderr and exits with status 1.
kura_die() {
  echo "$1" >&2
  exit 1
}

# kura_require MESSAGE FILE SHA256 [SIZE]: kura_verify, or refuse with MESSAGE.
kura_require() {
  local message=$1
  shift
  kura_verify "$@" || kura_die "$message"
}

# kura_tmpdir: makes a temporary folder, named by $KURA_TMP, removed when the script exits (with the
# partial copy of a kura_install cut short, if any).
kura_tmpdir() {
  KURA_TMP=$(mktemp -d)
  trap 'rm -rf "$KURA_TMP"; [ -z "${KURA_PART:-}" ] || rm -f "$KURA_PART"' EXIT
}

# kura_python: sets $PY to python3, else python.
kura_python() {
  PY=$(command -v python3 || command -v python) || kura_die "${0##*/}: no python3 or python on PATH"
}

# kura_pip_download DIR PIP-ARGUMENTS...: `pip download --no-deps` of the given requirements and options
# into DIR. pip's output goes to stderr: its progress bars when stderr is a terminal, nothing (--quiet)
# otherwise.
kura_pip_download() {
  local dir=$1
  shift
  [ -n "${PY:-}" ] || kura_python
  local quiet=(--quiet)
  if [ -t 2 ]; then
    quiet=()
  fi
  "$PY" -m pip download "${quiet[@]}" --no-deps --disable-pip-version-check "$@" -d "$dir" >&2
}

# kura_install SRC DEST: moves SRC to DEST, creating DEST's folder. When the two lie on different file
# systems the file is first copied next to DEST and then renamed, so DEST is never seen half written.
kura_install() {
  local src=$1 dest=$2
  mkdir -p "$(dirname "$dest")"
  KURA_PART="$dest.part.$$"
  mv -f "$src" "$KURA_PART" || kura_die "${0##*/}: could not move $src into $(dirname "$dest")"
  mv -f "$KURA_PART" "$dest"
  KURA_PART=
}

# kura_apt_install SCRIPT PACKAGE...: installs Debian packages with apt-get, as root or through sudo
# without a password; fails naming SCRIPT and the packages where neither is possible.
kura_apt_install() {
  local script=$1
  shift
  if ! command -v apt-get >/dev/null; then
    echo "$script: $* not installed and this machine has no apt-get; install them and put them on PATH" >&2
    return 1
  fi
  local sudo=()
  if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
      sudo=(sudo -n)
    else
      echo "$script: installing Debian's $* needs root (or passwordless sudo)" >&2
      return 1
    fi
  fi
  DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get -qq update >&2
  DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get -qq install -y --no-install-recommends "$@" >&2
}
