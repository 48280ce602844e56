#!/usr/bin/env bash
# Make the project venv: create it if missing, then `pip install -c $SCALELAB_CONSTRAINTS -e '.[labs,hub,dev]'`.
#
# A stamp file in the venv records a hash of pyproject.toml, the constraints file, the extras and the venv's
# Python, so a second run only checks (well under a second) and a change to any of them re-installs.
#
#   VENV                   where the venv lives (default .venv)
#   PYTHON                 the interpreter that creates it, >= 3.10 (default python3)
#   SCALELAB_CONSTRAINTS   pip constraints (default constraints/cpu.txt: torch==2.13.0 CPU); a GPU site passes its own
#   SCALELAB_EXTRAS        extras to install (default labs,hub,dev)
#
# `ensure_venv.sh --check` changes nothing: it says whether an install is due and exits 1 if so.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
# Paths given relative to where we were called from, made absolute before moving to the repository root.
VENV=$(realpath -m -- "${VENV:-$ROOT/.venv}")
CONSTRAINTS=$(realpath -m -- "${SCALELAB_CONSTRAINTS:-$ROOT/constraints/cpu.txt}")
EXTRAS=${SCALELAB_EXTRAS:-labs,hub,dev}
PYTHON=${PYTHON:-python3}
CHECK_ONLY=0
[ "${1:-}" = "--check" ] && CHECK_ONLY=1
cd "$ROOT"

die() { echo "ensure_venv: $*" >&2; exit 1; }

[ -f "$CONSTRAINTS" ] || die "constraints file $CONSTRAINTS not found; pass an existing one: make test SCALELAB_CONSTRAINTS=constraints/cpu.txt"

stamp_key() {  # hash of everything that decides what gets installed
  local pyver
  pyver=$("$VENV/bin/python" -c 'import sys; print(sys.version)')
  { cat pyproject.toml; echo "--- constraints"; cat "$CONSTRAINTS"; echo "--- extras $EXTRAS"; echo "--- python $pyver"; } \
    | sha256sum | cut -c1-16
}

if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c '' 2>/dev/null; then
  key=$(stamp_key)
  if [ -f "$VENV/.scalelab-setup-$key" ] && [ -x "$VENV/bin/scalelab" ]; then
    echo "ensure_venv: already up to date, ok ($VENV, stamp $key, constraints $CONSTRAINTS)"
    exit 0
  fi
  [ $CHECK_ONLY = 1 ] && { echo "ensure_venv: install due in $VENV (no stamp $key: pyproject.toml, constraints or extras changed)"; exit 1; }
else
  [ $CHECK_ONLY = 1 ] && { echo "ensure_venv: install due: no working venv at $VENV"; exit 1; }
  command -v "$PYTHON" >/dev/null || die "$PYTHON not found; install it: apt-get install python3 python3-venv python3-dev (or pass PYTHON=/path/to/python3.11)"
  "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))' \
    || die "$PYTHON is Python $("$PYTHON" -c 'import platform; print(platform.python_version())'); scalelab needs >= 3.10: pass PYTHON=/path/to/python3.11"
  echo "ensure_venv: creating $VENV with $("$PYTHON" -c 'import sys; print(sys.executable, sys.version.split()[0])')"
  if [ -e "$VENV" ] && [ -n "$(ls -A "$VENV")" ]; then
    [ -f "$VENV/pyvenv.cfg" ] || die "$VENV exists and is not a venv (no pyvenv.cfg); move it away or pass VENV=another/path"
    rm -rf "$VENV"  # a broken venv (interpreter moved or deleted) is rebuilt, not patched
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
