"""The GPU check script (tools/gpu_check.sh) runs end to end on a CPU at CI sizes, in a Python that has torch and
numpy but none of the project's other dependencies (a GPU machine's bare Python), so it cannot rot between the
times someone runs it on a GPU; its results JSON says what it measured on."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

from scalelab.train.gpt_bench import MODES, slug, pytest_summary

ROOT = Path(__file__).resolve().parent.parent
TORCH_ONLY = ["torch", "torchgen", "functorch", "numpy", "filelock", "typing_extensions", "setuptools",
              "_distutils_hack", "pkg_resources", "sympy", "mpmath", "networkx", "jinja2", "markupsafe", "fsspec"]
"""What a GPU machine's bare Python has: torch's wheel and its requirements, and numpy."""


def bare_python(tmp_path: Path) -> Path:
    """A Python that sees the standard library and TORCH_ONLY, nothing else: no Jupyter, no pytest, no psutil,
    no YAML, no scalelab installed (python -S: no site-packages; PYTHONPATH a folder of links to those packages)."""
    site = tmp_path / "bare-site"
    site.mkdir()
    for name in TORCH_ONLY:
        spec = importlib.util.find_spec(name)
        if spec is None:
            continue
        origin = Path(spec.submodule_search_locations[0]) if spec.submodule_search_locations else Path(spec.origin)
        (site / origin.name).symlink_to(origin)
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\nPYTHONPATH={site} exec {sys.executable} -S \"$@\"\n")
    python.chmod(0o755)
    return python


def test_the_gpu_check_runs_on_a_cpu_in_a_python_without_the_projects_dependencies(tmp_path):
    python = bare_python(tmp_path)
    probe = ("import importlib.util, torch, numpy; print([m for m in ('pytest', 'yaml', 'psutil', 'papermill', "
             "'jupyter_client', 'scalelab') if importlib.util.find_spec(m)])")
    has = subprocess.run([python, "-c", probe], capture_output=True, text=True, cwd=tmp_path)
    assert has.returncode == 0 and has.stdout.strip() == "[]", (has.stdout, has.stderr[-2000:])
    out = tmp_path / "results"
    proc = subprocess.run(["bash", str(ROOT / "tools" / "gpu_check.sh"), "--device", "cpu", "--tiny",
                           "--compile-backend", "eager", "--python", str(python), "--out", str(out), "--labs", "01"],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})  # as test_gpt: robust on a loaded machine
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "gpt.json").read_text())
    assert [r["mode"] for r in report["results"]] == list(MODES)
    for r in report["results"]:
        assert r["tokens_per_s"] > 0 and r["mfu"] is None and "no peak" in r["peak_source"]
        assert r["loss_last"] < r["loss_first"]  # it trained
    assert report["results"][2]["compile"] and report["results"][2]["compile_backend"] == "eager"
    assert report["device"] == "cpu" and report["torch"] and report["date"] and report["bf16_over_fp32"] > 0
    assert report["gpu_tests"].startswith("not run") and "pytest" in report["gpu_tests"]
    assert "done in" in proc.stderr
    # step 3 needs papermill and a kernel in that Python: without them it says so and the check still ends well
    assert (out / "labs.log").read_text().startswith("not run") and "papermill" in (out / "labs.log").read_text()


def test_the_check_names_a_devices_folder_and_reads_pytests_summary(tmp_path):
    assert slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    log = tmp_path / "gpu-tests.log"
    log.write_text("....\n===== 14 passed in 66.10s (0:01:06) =====\n time per test file\n(as JSON: x.json)\n")
    assert pytest_summary(log) == "14 passed in 66.10s (0:01:06)"
    assert pytest_summary(tmp_path / "absent.log").startswith("not run")
    bad = subprocess.run(["bash", str(ROOT / "tools" / "gpu_check.sh"), "--device", "tpu"], capture_output=True,
                         text=True)
    assert bad.returncode == 2 and "--device must be cuda or cpu" in bad.stderr
