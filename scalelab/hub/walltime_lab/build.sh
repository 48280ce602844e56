#!/bin/bash
# Rebuild the JupyterLab extension scalelab-walltime from src/ into ../jupyter_data/labextensions/scalelab-walltime
# and stamp the bundle with the source's SHA-256 (tests/test_hub_walltime.py checks the stamp against the source).
# Only after changing src/, package.json or package-lock.json; `make hub` and `make test` use the committed bundle.
# Needs node >= 18, npm and its registry (~15 s: npm ci, then rspack through jupyter-builder, JupyterLab's builder).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
venv="${VENV:-$here/../../../.venv}"
cd "$here"
npm ci --no-audit --no-fund
rm -rf ../jupyter_data/labextensions/scalelab-walltime
PATH="$venv/bin:$PATH" jupyter-builder build .
"$venv/bin/python" -c 'from scalelab.hub.walltime import stamp_bundle; stamp_bundle()'
echo "built: $(cd ../jupyter_data/labextensions/scalelab-walltime && pwd)"
