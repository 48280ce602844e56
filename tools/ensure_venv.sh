#!/usr/bin/env bash
# Make the project venv: create it if missing, then `pip install -c $SCALELAB_CONSTRAINTS -e '.[labs,hub,dev]'`.
#
# A stamp file in the venv records a hash of pyproject.toml, the constraints file, the extras and the venv's
# Python, so a second run only checks (well under a second) and a change to any of them re-installs.
#
#   VENV                   where the venv lives (default .venv)
#   PYTHON                 the interpreter that creates it, >= 3.10 (default python3; see "who can run it" below)
#   SCALELAB_CONSTRAINTS   pip constraints (default constraints/cpu.txt: torch==2.13.0 CPU); a GPU site passes its own
#   SCALELAB_EXTRAS        extras to install (default labs,hub,dev)
#
# `ensure_venv.sh --check` changes nothing: it says whether an install is due and exits 1 if so.
#
# Who can run it: students' servers and graded runs execute this venv as *other* users, so its interpreter must not
# sit under a folder they cannot enter (pyenv under root's 0700 home, for one). When the default python3 is such an
# interpreter, the system's /usr/bin/python3 of the same X.Y is used instead (and a venv made from a hidden one is
# rebuilt); an explicit PYTHON=... is used as given, with a warning.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
# Paths given relative to where we were called from, made absolute before moving to the repository root.
VENV=$(realpath -m -- "${VENV:-$ROOT/.venv}")
CONSTRAINTS=$(realpath -m -- "${SCALELAB_CONSTRAINTS:-$ROOT/constraints/cpu.txt}")
EXTRAS=${SCALELAB_EXTRAS:-labs,hub,dev}
PYTHON_GIVEN=${PYTHON:+1}
PYTHON=${PYTHON:-python3}
[ "$PYTHON" = python3 ] && PYTHON_GIVEN=""  # the Makefile's default is not a choice
CHECK_ONLY=0
[ "${1:-}" = "--check" ] && CHECK_ONLY=1
cd "$ROOT"

die() { echo "ensure_venv: $*" >&2; exit 1; }

hidden_dir() {  # the first folder on the real path of $1 that other users may not enter (no o+x), or nothing
  local p d="" part parts
  p=$(realpath -- "$1" 2>/dev/null) || return 0
  IFS=/ read -ra parts <<< "${p#/}"
  for part in "${parts[@]:0:${#parts[@]}-1}"; do
    d="$d/$part"
    if [ -d "$d" ] && [ $(( 0$(stat -c %a "$d") & 1 )) -eq 0 ]; then echo "$d"; return 0; fi
  done
  return 0
}

base_python() {  # the interpreter a venv (or the given python) really runs
  "$1" -c 'import os, sys; print(os.path.realpath(getattr(sys, "_base_executable", sys.executable)))' 2>/dev/null
}

pick_python() {  # PYTHON, or a system python3 of the same X.Y when PYTHON sits where other users cannot go
  local base blocked ver sys
  command -v "$PYTHON" >/dev/null || return 0
  base=$(base_python "$PYTHON") || return 0
  blocked=$(hidden_dir "$base")
  [ -z "$blocked" ] && return 0
  if [ -n "$PYTHON_GIVEN" ]; then
    echo "ensure_venv: warning: $base is under $blocked, which other users cannot enter: students' servers and graded runs cannot run this venv as their own accounts" >&2
    return 0
  fi
  ver=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
  for sys in "/usr/bin/python$ver" /usr/bin/python3; do
    if [ -x "$sys" ] && [ -z "$(hidden_dir "$sys")" ] \
       && [ "$("$sys" -c 'import sys; print("%d.%d" % sys.version_info[:2])')" = "$ver" ] && "$sys" -c 'import venv, ensurepip' 2>/dev/null; then
      echo "ensure_venv: $base is under $blocked (other users cannot enter it); using $sys so that students' accounts can run the venv"
      PYTHON=$sys
      return 0
    fi
  done
  echo "ensure_venv: warning: $base is under $blocked and no system python$ver with venv was found (apt-get install -y python3-venv): students' accounts cannot run this venv" >&2
}
pick_python

[ -f "$CONSTRAINTS" ] || die "constraints file $CONSTRAINTS not found; pass an existing one: make test SCALELAB_CONSTRAINTS=constraints/cpu.txt"

stamp_key() {  # hash of everything that decides what gets installed
  local pyver
  pyver=$("$VENV/bin/python" -c 'import sys; print(sys.version)')
  # the checkout too: the editable install points at it, and a venv another checkout installed into imports that one
  { cat pyproject.toml; echo "--- constraints"; cat "$CONSTRAINTS"; echo "--- extras $EXTRAS"; echo "--- python $pyver"
    echo "--- checkout $(pwd -P)"; } \
    | sha256sum | cut -c1-16
}

rebuild=""
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c '' 2>/dev/null && [ -z "$PYTHON_GIVEN" ] \
   && [ -n "$(hidden_dir "$(base_python "$VENV/bin/python")")" ] && [ -z "$(hidden_dir "$(base_python "$PYTHON")")" ]; then
  rebuild="its interpreter $(base_python "$VENV/bin/python") is hidden from other users"
fi
if [ -z "$rebuild" ] && [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c '' 2>/dev/null; then
  key=$(stamp_key)
  if [ -f "$VENV/.scalelab-setup-$key" ] && [ -x "$VENV/bin/scalelab" ]; then
    echo "ensure_venv: already up to date, ok ($VENV, stamp $key, constraints $CONSTRAINTS)"
    exit 0
  fi
  [ $CHECK_ONLY = 1 ] && { echo "ensure_venv: install due in $VENV (no stamp $key: pyproject.toml, constraints or extras changed)"; exit 1; }
else
  [ $CHECK_ONLY = 1 ] && { echo "ensure_venv: install due: ${rebuild:-no working venv at $VENV}"; exit 1; }
  [ -n "$rebuild" ] && echo "ensure_venv: rebuilding $VENV: $rebuild"
  command -v "$PYTHON" >/dev/null || die "$PYTHON not found; install it: apt-get install python3 python3-venv python3-dev (or pass PYTHON=/path/to/python3.11)"
  "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))' \
    || die "$PYTHON is Python $("$PYTHON" -c 'import platform; print(platform.python_version())'); scalelab needs >= 3.10: pass PYTHON=/path/to/python3.11"
  echo "ensure_venv: creating $VENV with $("$PYTHON" -c 'import sys; print(sys.executable, sys.version.split()[0])')"
  if [ -e "$VENV" ] && [ -n "$(ls -A "$VENV")" ]; then
    [ -f "$VENV/pyvenv.cfg" ] || die "$VENV exists and is not a venv (no pyvenv.cfg); move it away or pass VENV=another/path"
    rm -rf "$VENV"  # a broken venv (interpreter moved or deleted, or hidden from students) is rebuilt, not patched
  fi
  "$PYTHON" -m venv "$VENV" || die "'$PYTHON -m venv $VENV' failed; install the venv module: apt-get install python3-venv"
  # The pip that ensurepip bundles may be years old; setuptools and wheel are for builds without isolation (Horovod).
  "$VENV/bin/python" -m pip install -q --upgrade pip setuptools wheel || die "could not upgrade pip in $VENV (output above)"
  key=$(stamp_key)
fi

rm -f "$VENV"/.scalelab-setup-*  # before pip: a failed install must not leave an older stamp claiming the venv is fine
# pip's output (setuptools prints pages of deprecation banners) goes to a log, shown only when pip fails.
log="$VENV/.scalelab-pip.log"
echo "ensure_venv: pip install -c $CONSTRAINTS -e '.[$EXTRAS]' into $VENV (a few minutes on a fresh venv; log: $log)"
"$VENV/bin/python" -m pip install -c "$CONSTRAINTS" -e ".[$EXTRAS]" > "$log" 2>&1 \
  || { tail -40 "$log" >&2; die "pip install failed (the end of $log is above); after fixing, re-run: bash tools/ensure_venv.sh"; }
# Fail here, not in the first test, if the install left torch or scalelab unimportable; torch's version in the
# output shows at once a build other than the one pinned (a CUDA wheel where the CPU one was meant).
"$VENV/bin/python" -c 'import torch, scalelab; print("ensure_venv: torch", torch.__version__, "| scalelab", scalelab.__version__)' \
  || die "the venv was installed but 'import torch, scalelab' fails in $VENV"
printf 'pyproject+constraints+extras+python hash %s\nconstraints %s\nextras %s\n' "$key" "$CONSTRAINTS" "$EXTRAS" \
  > "$VENV/.scalelab-setup-$key"
echo "ensure_venv: ready ($VENV, stamp $key)"
