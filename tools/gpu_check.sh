#!/usr/bin/env bash
# The GPU check (issue 33): one script anyone runs on a machine with one GPU, in at most 8 minutes.
#
#   tools/gpu_check.sh                       # on the GPU machine, from the checkout
#   tools/gpu_check.sh --device cpu --tiny   # the same steps at CI sizes on a CPU (tests/test_gpu_check.py)
#
# Steps, each bounded by `timeout`:
#   1. the `gpu`-marked tests (pytest -m gpu), when this Python has pytest and the project's dependencies;
#   2. the engine's gpt (scalelab.train.gpt_bench): preset 100m at fp32, bf16 and bf16 + torch.compile, fused AdamW:
#      tokens/s, step time, MFU against the device's peak (train/gpt.py's PEAK_TFLOPS);
#   3. (a hook, off by default) the labs' single-GPU sections under papermill: --labs 01,06,07 runs
#      `scalelab labs run <lab> --profile gpu-1` for each, once the labs have a gpu-1 profile (issue 33 item 3).
# Results land in bench/gpu/<device>/ (gpt.json: device, driver, CUDA, torch, date, the numbers; gpu-tests.log;
# labs.log); commit that folder as the device's reference results.
#
# Step 2 needs torch and numpy only, so it runs in a GPU machine's bare Python (no Jupyter, no project extras).
# Bringing wheels to a machine without internet: bench/gpu/README.md.
set -euo pipefail

usage() {
    sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'
    cat <<'EOF'
Options:
  --device cuda|cpu      where to measure (default cuda)
  --tiny                 CI sizes: the tiny preset, a few steps (seconds on a CPU)
  --out DIR              results folder (default bench/gpu/<device name>)
  --python PY            the Python to use (default: $PYTHON, else .venv/bin/python, else python3)
  --compile-backend B    torch.compile backend (default inductor; eager runs the code path without a compiler)
  --skip-tests           leave out step 1
  --labs LIST            step 3 for these labs (comma-separated numbers, e.g. 01,06,07)
  --budget S             warn when the check took longer than S seconds (default 480)
EOF
}

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEVICE=cuda TINY=0 OUT="" PY="${PYTHON:-}" BACKEND=inductor SKIP_TESTS=0 LABS="" BUDGET=480
while [ $# -gt 0 ]; do
    case "$1" in
        --device) DEVICE="$2"; shift 2 ;;
        --tiny) TINY=1; shift ;;
        --out) OUT="$2"; shift 2 ;;
        --python) PY="$2"; shift 2 ;;
        --compile-backend) BACKEND="$2"; shift 2 ;;
        --skip-tests) SKIP_TESTS=1; shift ;;
        --labs) LABS="$2"; shift 2 ;;
        --budget) BUDGET="$2"; shift 2 ;;
        -h|--help) usage; exit 0 ;;
        *) echo "gpu_check: unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
done
case "$DEVICE" in cuda|cpu) ;; *) echo "gpu_check: --device must be cuda or cpu, not $DEVICE" >&2; exit 2 ;; esac
if [ -z "$PY" ]; then
    if [ -x "$ROOT/.venv/bin/python" ]; then PY="$ROOT/.venv/bin/python"; else PY=python3; fi
fi
cd "$ROOT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"  # the checkout's scalelab, installed or not
START=$(date +%s)
say() { echo "gpu_check [$(( $(date +%s) - START )) s]: $*" >&2; }

NAME=$("$PY" - "$DEVICE" <<'EOF'
import sys
try:
    import numpy, torch
except ImportError as e:
    sys.exit(f"gpu_check: {sys.executable} cannot import torch and numpy ({e}); install them (bench/gpu/README.md "
             "says how on a machine without internet)")
from scalelab.train.gpt_bench import slug
if sys.argv[1] == "cuda":
    if not torch.cuda.is_available():
        sys.exit("gpu_check: --device cuda, but torch sees no CUDA device (torch " + torch.__version__ + ")")
    print(slug(torch.cuda.get_device_name(0)))
else:
    print("cpu")
EOF
) || { echo "gpu_check: $PY could not name the device (above: why)" >&2; exit 3; }
OUT="${OUT:-$ROOT/bench/gpu/$NAME}"
mkdir -p "$OUT"
say "device $NAME, python $PY, results in $OUT"

# 1. the gpu-marked tests (they skip on a CPU; without pytest or the project's dependencies they are not run)
TESTS_LOG="$OUT/gpu-tests.log"
if [ "$SKIP_TESTS" = 1 ]; then
    echo "not run (--skip-tests)" > "$TESTS_LOG"
elif "$PY" -c "import pytest, psutil, yaml" 2>/dev/null; then
    say "step 1: pytest -m gpu"
    FILES=$(grep -l "mark.gpu" tests/test_*.py | tr '\n' ' ')
    # shellcheck disable=SC2086
    timeout 300 "$PY" -m pytest -q -m gpu -p no:cacheprovider $FILES > "$TESTS_LOG" 2>&1 \
        || say "step 1: the gpu tests FAILED (exit $?): see $TESTS_LOG"
else
    echo "not run: $PY lacks pytest or the project's dependencies (pip install -e '.[dev]'; bench/gpu/README.md)" > "$TESTS_LOG"
fi
say "step 1: $(grep -E "^=* ?[0-9]+ (passed|failed|skipped|deselected)|no tests ran|^not run" "$TESTS_LOG" | tail -n 1)"

# 2. the engine's gpt: fp32, bf16, bf16 + compile
say "step 2: the gpt's tokens/s and MFU"
SIZE=()
[ "$TINY" = 1 ] && SIZE=(--tiny)
timeout 360 "$PY" -m scalelab.train.gpt_bench --device "$DEVICE" "${SIZE[@]}" --compile-backend "$BACKEND" \
    --tests-log "$TESTS_LOG" --out "$OUT/gpt.json"

# 3. the labs' single-GPU sections (hook: off unless --labs names them)
if [ -n "$LABS" ]; then
    : > "$OUT/labs.log"
    for lab in ${LABS//,/ }; do
        say "step 3: lab $lab at profile gpu-1"
        if timeout 240 "$PY" -m scalelab.cli labs run "$lab" --profile gpu-1 --out "$OUT/labs/$lab" >> "$OUT/labs.log" 2>&1; then
            echo "lab $lab: ok" >> "$OUT/labs.log"
        else
            echo "lab $lab: FAILED or no gpu-1 profile (exit $?)" >> "$OUT/labs.log"
        fi
    done
fi

TOOK=$(( $(date +%s) - START ))
say "done in $TOOK s: $OUT/gpt.json"
if [ "$TOOK" -gt "$BUDGET" ]; then
    say "WARNING: the check took $TOOK s, over its budget of $BUDGET s"
fi
