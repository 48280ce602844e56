#!/usr/bin/env bash
# Make sure the Debian packages scalelab needs are installed; quick (one dpkg-query) when they are.
#
#   openmpi-bin libopenmpi-dev   mpirun, and mpicc for the Horovod build
#   slurm-wlm munge              the local single-node Slurm cluster the hub and the tests use
#   slurmdbd mariadb-server      its accounting: associations and the per-student QOS (scalelab/cluster/accounting.py);
#                                the cluster runs its own private mariadbd and slurmdbd, never the system services
#                                (on a fresh container: ~10 s and ~195 MB, 35 packages with their dependencies)
#   chromium chromium-driver     headless browser tests (playwright with executable_path=/usr/bin/chromium)
#   sudo                         batchspawner's default exec_prefix is `sudo -E -u {username}`
#   build-essential              the Horovod build (g++; its cmake < 4 comes from PyPI into the venv)
#   git make                     the set-up itself
#   python3 python3-venv python3-dev   Debian's Python: the venv is built from it when the default python3 sits
#                                where students' accounts cannot run it (pyenv under /root; see ensure_venv.sh)
# plus, only when missing: python3-venv / python3-dev for another PYTHON, nodejs npm.
#
# As root it runs `apt-get update` once and installs what is missing; as another user it prints the exact
# command to run and fails. SCALELAB_DEBIAN_EXTRA="pkg ..." adds site-specific packages.
set -euo pipefail
PYTHON=${PYTHON:-python3}
PACKAGES=(openmpi-bin libopenmpi-dev slurm-wlm munge slurmdbd mariadb-server chromium chromium-driver sudo
          build-essential git make python3 python3-venv python3-dev)
# shellcheck disable=SC2206  # word splitting is the point: a space-separated list of names
PACKAGES+=(${SCALELAB_DEBIAN_EXTRA:-})

# The Python and Node tool chains may come from elsewhere (pyenv, nodesource): install Debian's only when absent.
if ! command -v "$PYTHON" >/dev/null; then
  PACKAGES+=(python3 python3-venv python3-dev)
else
  "$PYTHON" -c "import ensurepip, venv" 2>/dev/null || PACKAGES+=(python3-venv)
  "$PYTHON" -c "import os, sysconfig, sys; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()['include'], 'Python.h')))" \
    2>/dev/null || PACKAGES+=(python3-dev)
fi
command -v npm >/dev/null || PACKAGES+=(nodejs npm)

# One dpkg-query for all of them; names it does not know at all are missing too.
installed=$(dpkg-query -W -f='${Package} ${db:Status-Abbrev}\n' "${PACKAGES[@]}" 2>/dev/null | awk '$2 == "ii" {print $1}' || true)
missing=()
for p in "${PACKAGES[@]}"; do
  grep -qx -- "$p" <<<"$installed" || missing+=("$p")
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "ensure_debian: already installed, ok (${#PACKAGES[@]} packages: ${PACKAGES[*]})"
  exit 0
fi

fix="apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y ${missing[*]}"
if [ "$(id -u)" -ne 0 ]; then
  echo "ensure_debian: missing Debian packages: ${missing[*]}" >&2
  echo "ensure_debian: not root, so not installing them; run as root:" >&2
  echo "  $fix" >&2
  exit 1
fi

echo "ensure_debian: installing missing Debian packages: ${missing[*]}"
apt-get update -q
DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}" || {
  echo "ensure_debian: apt-get install failed for: ${missing[*]}; after fixing apt, re-run:" >&2
  echo "  $fix" >&2
  exit 1
}
echo "ensure_debian: installed ${missing[*]}"
