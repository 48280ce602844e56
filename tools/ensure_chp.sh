#!/usr/bin/env bash
# Make configurable-http-proxy (JupyterHub's proxy, from npm) available as $VENV/bin/configurable-http-proxy.
#
# It is installed under $VENV/node (not globally) so that it comes and goes with the venv, and linked into the
# venv's bin directory so that anything running with the venv's bin on PATH (make hub, make test) finds it.
# CHP_VERSION pins it; the default follows node: 5.x needs node >= 20, Debian 12's own node is 18 (4.6.x).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV=$(realpath -m -- "${VENV:-$ROOT/.venv}")
BIN="$VENV/bin/configurable-http-proxy"

die() { echo "ensure_chp: $*" >&2; exit 1; }

command -v node >/dev/null && command -v npm >/dev/null \
  || die "node/npm not found; install them: apt-get install -y nodejs npm (or run: bash tools/ensure_debian.sh)"
node_major=$(node -p 'process.versions.node.split(".")[0]')
if [ -z "${CHP_VERSION:-}" ]; then
  if [ "$node_major" -ge 20 ]; then CHP_VERSION=5.3.0; else CHP_VERSION=4.6.3; fi
fi
[ -d "$VENV/bin" ] || die "no venv at $VENV; create it first: bash tools/ensure_venv.sh"

if [ -x "$BIN" ] && found=$("$BIN" --version 2>/dev/null) && [ "$found" = "$CHP_VERSION" ]; then
  echo "ensure_chp: already installed, ok (configurable-http-proxy $found at $BIN, node $(node --version))"
  exit 0
fi

echo "ensure_chp: installing configurable-http-proxy@$CHP_VERSION into $VENV/node (found: ${found:-none})"
npm install --prefix "$VENV/node" --no-audit --no-fund --loglevel=error "configurable-http-proxy@$CHP_VERSION" \
  || die "npm install failed (output above); after fixing npm, re-run: bash tools/ensure_chp.sh"
# Relative, so the venv can be moved together with its node directory.
ln -sfn ../node/node_modules/.bin/configurable-http-proxy "$BIN"
found=$("$BIN" --version) || die "installed, but '$BIN --version' fails"
[ "$found" = "$CHP_VERSION" ] || die "installed $CHP_VERSION, but $BIN reports $found"
echo "ensure_chp: configurable-http-proxy $found ready ($BIN)"
