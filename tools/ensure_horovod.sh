#!/usr/bin/env bash
# Make Horovod (Gloo + MPI, PyTorch) importable in the venv, building its wheel at most once per machine.
#
# Why a build: horovod 0.28.1 (the newest release) hard-codes C++14 in its CMake files, and current
# PyTorch headers need C++17, so `pip install horovod` fails. We patch the standard to 17 in the sdist,
# build a wheel once and cache it (keyed by Python, torch and horovod versions) so later set-ups reuse it.
#
#   VENV (default .venv) or PY (default $VENV/bin/python)   the environment to install into
#   HVD_VERSION (default 0.28.1), SCALELAB_CACHE (default ~/.cache/scalelab)   what to build, where to keep it
set -euo pipefail
VENV=${VENV:-.venv}
PY=${PY:-$VENV/bin/python}
HVD_VERSION=${HVD_VERSION:-0.28.1}
CACHE=${SCALELAB_CACHE:-$HOME/.cache/scalelab}/wheels

if found=$("$PY" -c "import horovod, horovod.torch; print(horovod.__version__)" 2>/dev/null); then
  echo "ensure_horovod: already installed, ok (horovod $found in $PY)"
  exit 0
fi
[ -x "$PY" ] || { echo "ensure_horovod: no Python at $PY; create the venv first: bash tools/ensure_venv.sh" >&2; exit 1; }
command -v mpicc >/dev/null || { echo "ensure_horovod: mpicc not found; install Open MPI: apt-get install openmpi-bin libopenmpi-dev" >&2; exit 1; }
command -v g++ >/dev/null || { echo "ensure_horovod: g++ not found; install it: apt-get install build-essential" >&2; exit 1; }
# The build runs cmake from PATH: the venv's bin first, where the wheel build below puts PyPI's cmake < 4.
export PATH="$(dirname "$PY"):$PATH"

key=$("$PY" -c "import sys, torch; print(f'py{sys.version_info[0]}{sys.version_info[1]}-torch{torch.__version__.split(\"+\")[0]}')")
dest="$CACHE/horovod-$HVD_VERSION-$key"
mkdir -p "$dest"
# Two set-ups at once (two people, or make -j) must not build into the same directory: the second waits.
exec 9>"$dest/.lock"
flock 9
wheel=$(ls "$dest"/horovod-*.whl 2>/dev/null | head -1 || true)
if [ -z "$wheel" ]; then
  echo "ensure_horovod: building horovod $HVD_VERSION wheel (once per machine, ~7 min on 2 cores) ..."
  # --no-build-isolation below builds with what the venv has: cmake < 4 (horovod 0.28.1's CMake files predate
  # CMake 4's removed policies), setuptools and wheel (a fresh venv may lack them).
  "$PY" -m pip install -q 'cmake<4' setuptools wheel
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  "$PY" -m pip download -q --no-deps --no-binary :all: -d "$work" "horovod==$HVD_VERSION"
  tar -xzf "$work"/horovod-*.tar.gz -C "$work"
  src=$(echo "$work"/horovod-"$HVD_VERSION")
  sed -i 's/CMAKE_CXX_STANDARD 14/CMAKE_CXX_STANDARD 17/; s/-std=c++14/-std=c++17/g' "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt"
  grep -q "CMAKE_CXX_STANDARD 17\|c++17" "$src/CMakeLists.txt" || { echo "ensure_horovod: C++17 patch did not apply to $src/CMakeLists.txt" >&2; exit 1; }
  HOROVOD_WITH_PYTORCH=1 HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
  HOROVOD_WITH_GLOO=1 HOROVOD_WITH_MPI=1 MAKEFLAGS=-j"$(nproc)" \
    "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$dest" "$src" > "$work/build.log" 2>&1 \
    || { tail -40 "$work/build.log" >&2; echo "ensure_horovod: build failed (log above)" >&2; exit 1; }
  wheel=$(ls "$dest"/horovod-*.whl | head -1)
fi
"$PY" -m pip install -q --no-deps "$wheel"
# horovod's own runtime dependencies (it declares them, but --no-deps skipped them)
"$PY" -m pip install -q cloudpickle psutil pyyaml packaging
"$PY" -c "import horovod.torch" || { echo "ensure_horovod: installed $wheel but 'import horovod.torch' fails" >&2; exit 1; }
echo "ensure_horovod: horovod $HVD_VERSION ready ($wheel)"
