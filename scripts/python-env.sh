# Sourced by scripts/setup, scripts/serve and scripts/test (not run on its own): which Python lmcache
# is installed into and runs from, so that all three agree.
#
#   $PYTHON set            that interpreter, whatever it is (.ci/run: the fresh virtualenv it made)
#   python3 in a venv      the active virtualenv (you ran `. some-venv/bin/activate`)
#   otherwise              .venv in this checkout, made here on first use: a fresh machine needs
#                          nothing before it, and a system Python that refuses installs (PEP 668,
#                          Debian's) is never installed into. `. .venv/bin/activate` then puts the
#                          `lmcache` command on your PATH.
#
# choose_python sets PY, the interpreter's path.
# Run from the checkout's root.

LOCAL_VENV=.venv

choose_python() {
  if [ -n "${PYTHON:-}" ]; then
    PY=$PYTHON
  elif command -v python3 >/dev/null 2>&1 &&
      python3 -c 'import sys; sys.exit(sys.prefix == sys.base_prefix)' 2>/dev/null; then
    PY=$(command -v python3)  # an activated virtualenv
  else
    PY=$PWD/$LOCAL_VENV/bin/python
    [ -x "$PY" ] || make_local_venv
  fi
}

make_local_venv() {
  local base
  base=$(command -v python3) || {
    echo "setup: no python3 on PATH (Debian/Ubuntu: apt-get install python3 python3-venv)" >&2
    exit 1
  }
  if [ -e "$LOCAL_VENV" ]; then
    echo "setup: $LOCAL_VENV exists but holds no working Python: remove it and run again" >&2
    exit 1
  fi
  echo "setup: making a virtualenv in $LOCAL_VENV ($("$base" --version 2>&1), $base)"
  if ! venv_from "$base"; then
    # Debian and Ubuntu ship the venv module's pip bootstrap (ensurepip) as its own package.
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
      echo "setup: $base cannot make a virtualenv with pip; installing python3-venv (Debian package)"
      apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >/dev/null
    fi
    venv_from "$base" || {
      echo "setup: $base cannot make a virtualenv with pip (Debian/Ubuntu: apt-get install" \
           "python3-venv), or point PYTHON at an interpreter to install into" >&2
      exit 1
    }
  fi
}

venv_from() {  # make .venv with a working pip, or leave none behind
  if "$1" -m venv "$LOCAL_VENV" >/dev/null 2>&1 && "$LOCAL_VENV/bin/python" -m pip --version >/dev/null 2>&1; then
    return 0
  fi
  rm -rf "$LOCAL_VENV"
  return 1
}

# What a finished setup records in the environment it installed into: this checkout and its
# pyproject.toml, so scripts/serve can tell that nothing needs installing again.
setup_stamp_path() { "$PY" -c 'import sys; print(sys.prefix)' | sed 's|$|/.lmcache-setup-stamp|'; }
setup_stamp() { echo "$(pwd -P) $(sha256sum pyproject.toml | cut -d' ' -f1)"; }
