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
#   3. (off by default) the labs under papermill at their one-GPU profile: --labs 01,06,07 runs
#      `scalelab labs run <lab> --profile gpu-1` for each (lab.yaml's gpu-1: the notebook's "one GPU" column),
#      needs papermill and ipykernel in this Python (bench/gpu/README.md: wheels).
# Results land in bench/gpu/<device>/ (gpt.json: device, driver, CUDA, torch, date, the numbers; gpu-tests.log;
# labs.log with each lab's cell times; labs/<lab>.ipynb, the executed notebook without its images); commit that
# folder as the device's reference results.
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
  --skip-bench           leave out step 2 (e.g. to time the labs alone; gpt.json is not written)
  --labs LIST            step 3 for these labs (comma-separated numbers, e.g. 01,06,07)
  --lab-timeout S        step 3's limit per lab (default 240)
  --budget S             warn when the check took longer than S seconds (default 480)
EOF
}

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEVICE=cuda TINY=0 OUT="" PY="${PYTHON:-}" BACKEND=inductor SKIP_TESTS=0 SKIP_BENCH=0 LABS="" BUDGET=480 LAB_TIMEOUT=240
while [ $# -gt 0 ]; do
    case "$1" in
        --device) DEVICE="$2"; shift 2 ;;
        --tiny) TINY=1; shift ;;
        --out) OUT="$2"; shift 2 ;;
        --python) PY="$2"; shift 2 ;;
        --compile-backend) BACKEND="$2"; shift 2 ;;
        --skip-tests) SKIP_TESTS=1; shift ;;
        --skip-bench) SKIP_BENCH=1; shift ;;
        --labs) LABS="$2"; shift 2 ;;
        --budget) BUDGET="$2"; shift 2 ;;
        --lab-timeout) LAB_TIMEOUT="$2"; shift 2 ;;
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
if [ "$SKIP_BENCH" = 1 ]; then
    say "step 2: not run (--skip-bench)"
else
    say "step 2: the gpt's tokens/s and MFU"
    SIZE=()
    [ "$TINY" = 1 ] && SIZE=(--tiny)
    timeout 360 "$PY" -m scalelab.train.gpt_bench --device "$DEVICE" "${SIZE[@]}" --compile-backend "$BACKEND" \
        --tests-log "$TESTS_LOG" --out "$OUT/gpt.json"
fi

# 3. the labs' single-GPU sections: each lab's gpu-1 profile under papermill, in a scratch folder (the runs'
# checkpoints and traces stay there); kept: the executed notebook, trimmed of images, and each cell's seconds
if [ -n "$LABS" ]; then
    : > "$OUT/labs.log"
    if ! "$PY" -c "import papermill, ipykernel, nbclient, yaml, psutil" 2>/dev/null; then
        echo "not run: $PY lacks papermill, ipykernel, nbclient, pyyaml or psutil (bench/gpu/README.md: wheels)" \
            >> "$OUT/labs.log"
        say "step 3: not run ($PY cannot import papermill and the kernel: see $OUT/labs.log)"
    else
        SCRATCH=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check_labs.XXXXXX")
        if ! "$PY" -c "import scalelab.widgets" 2>/dev/null; then
            # a checkout that is not installed: scalelab.widgets lives in widgets/ (pyproject's package-dir), so the
            # notebooks' `from scalelab.widgets import ...` fails; a package folder of links joins the two
            mkdir -p "$SCRATCH/pkg/scalelab"
            for f in "$ROOT"/scalelab/*; do ln -s "$f" "$SCRATCH/pkg/scalelab/"; done
            ln -s "$ROOT/widgets" "$SCRATCH/pkg/scalelab/widgets"
            export PYTHONPATH="$SCRATCH/pkg:$PYTHONPATH"
        fi
        mkdir -p "$OUT/labs"
        for lab in ${LABS//,/ }; do
            dir=$(find labs -mindepth 1 -maxdepth 1 -type d \( -name "$lab" -o -name "${lab}_*" \) | sort | head -n 1)
            if [ -z "$dir" ]; then
                echo "lab $lab: no such lab under labs/" >> "$OUT/labs.log"; continue
            fi
            name=$(basename "$dir")
            say "step 3: lab $name at profile gpu-1"
            t0=$(date +%s)
            if timeout "$LAB_TIMEOUT" "$PY" -m scalelab.cli labs run "$dir" --profile gpu-1 --out "$SCRATCH/$name" \
                    >> "$OUT/labs.log" 2>&1; then
                status=ok
            else
                status="FAILED (exit $?)"
            fi
            took=$(( $(date +%s) - t0 ))
            echo "lab $name: $status in $took s" >> "$OUT/labs.log"
            say "step 3: lab $name: $status in $took s"
            "$PY" - "$SCRATCH/$name/lab.ipynb" "$OUT/labs/$name.ipynb" >> "$OUT/labs.log" 2>&1 <<'PYEOF' || true
import json, sys
src, dst = sys.argv[1:3]
try:
    nb = json.load(open(src, encoding="utf-8"))
except (OSError, ValueError) as e:
    sys.exit(f"  no executed notebook: {e}")
for i, cell in enumerate(nb["cells"]):
    for out in cell.get("outputs", []):
        data = out.get("data", {})
        for key in [k for k in data if k.startswith("image/") or k in ("text/html", "application/vnd.jupyter.widget-view+json")]:
            data.pop(key)
            data.setdefault("text/plain", f"[{key} left out of the reference copy]")
    pm = cell.get("metadata", {}).get("papermill", {})
    if cell["cell_type"] == "code" and pm.get("duration") is not None:
        print(f"  cell {i:3d}: {pm['duration']:7.1f} s  {''.join(cell['source']).splitlines()[0][:70] if cell['source'] else ''}")
json.dump(nb, open(dst, "w", encoding="utf-8"), indent=1, ensure_ascii=False)
PYEOF
        done
        rm -rf "$SCRATCH"
    fi
fi

TOOK=$(( $(date +%s) - START ))
say "done in $TOOK s: $OUT"
if [ "$TOOK" -gt "$BUDGET" ]; then
    say "WARNING: the check took $TOOK s, over its budget of $BUDGET s"
fi
