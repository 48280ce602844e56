"""Each lab's parameter profiles (lab.yaml `profiles:`, run by `scalelab labs run <lab> --profile <name>`) name only
the notebook's own parameters, and a lab's `gpu-node` profile is exactly the notebook's table of GPU-node
parameters: the table is what a student reads, the profile what an instructor runs on a GPU node. Before this test
they had drifted apart (lab 02's profile kept 2 workers and the CPU message sizes on a 4-GPU node).

The same table's `one GPU` column is the lab's `gpu-1` profile, for the hub's one-GPU spawn profile (one GPU, 16 CPU
cores; issue 33): every lab has one, and it is what tools/gpu_check.sh --labs runs."""
from __future__ import annotations

import json

import pytest

from scalelab.course.lab import find_labs, load_lab, parameter_defaults, parameter_table

from labtests import ROOT

LABS = find_labs(ROOT / "labs")


@pytest.mark.parametrize("lab_dir", LABS, ids=[p.name for p in LABS])
def test_profiles_name_only_the_notebooks_parameters(lab_dir):
    lab, defaults = load_lab(lab_dir), parameter_defaults(lab_dir / "lab.ipynb")
    assert defaults, f"{lab.name}: no parameters cell with literal defaults"
    for name, params in {"ci": lab.grading.parameters, **lab.profiles}.items():
        unknown = sorted(set(params) - set(defaults))
        assert not unknown, f"{lab.name}: profile {name} sets {unknown}, which the parameters cell does not have"


TABLED = [p for p in LABS if parameter_table(p / "lab.ipynb")]


def test_every_lab_has_a_gpu_table():
    assert {p.name[:2] for p in TABLED} >= {f"{n:02d}" for n in range(1, 12)}, [p.name for p in TABLED]


COLUMNS = {"gpu-node": "GPU node", "gpu-1": "one GPU"}  # profile: the table's column
# Labs whose table has no `one GPU` column and lab.yaml no gpu-1 profile yet (issue 33 item 3, lab by lab): strict
# xfail, so a lab that gains them must leave this set.
GPU1_PENDING: set[str] = set()


def _cases():
    for lab_dir in TABLED:
        for profile_name in COLUMNS:
            marks = [pytest.mark.xfail(strict=True, reason="no gpu-1 profile yet")] \
                if profile_name == "gpu-1" and lab_dir.name[:2] in GPU1_PENDING else []
            yield pytest.param(lab_dir, profile_name, id=f"{lab_dir.name}-{profile_name}", marks=marks)


@pytest.mark.parametrize("lab_dir,profile_name", list(_cases()))
def test_gpu_profiles_are_the_notebooks_gpu_table(lab_dir, profile_name):
    lab, defaults = load_lab(lab_dir), parameter_defaults(lab_dir / "lab.ipynb")
    table = parameter_table(lab_dir / "lab.ipynb", column=COLUMNS[profile_name])
    assert table, f"{lab.name}: the notebook's GPU table has no {COLUMNS[profile_name]!r} column"
    for name, (cpu, _) in table.items():
        assert name in defaults, f"{lab.name}: the table lists {name}, which the parameters cell does not have"
        assert cpu == defaults[name], f"{lab.name}: the table's CPU default of {name} is {cpu!r}, the cell's " \
                                      f"{defaults[name]!r}"
    profile = lab.profiles.get(profile_name)
    assert profile is not None, f"{lab.name}: the notebook has a GPU table but lab.yaml no {profile_name} profile"
    want = {name: gpu for name, (_, gpu) in table.items() if gpu is not None}
    assert profile == want, f"{lab.name}: {profile_name} profile {profile} is not the notebook's table {want}"


def _notebook(tmp_path, markdown: str):
    nb = {"cells": [{"cell_type": "markdown", "metadata": {}, "source": markdown.splitlines(keepends=True)}],
          "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    path = tmp_path / "lab.ipynb"
    path.write_text(json.dumps(nb))
    return path


def test_the_table_parser_reads_several_names_remarks_and_descriptions(tmp_path):
    path = _notebook(tmp_path, "\n".join([
        "Some text first.", "",
        "| parameter | CPU default | GPU node |",
        "|---|---|---|",
        "| `preset` | `\"tiny\"` | `\"gpu-node\"` |",
        "| `steps`, `every` | 30, 5 | 200, 20 |",
        "| `sizes` | `[1, 2]` | `[1, 2, 4]` (a remark, in parentheses) |",
        "| `root` | `\"\"` (under `out_dir`) | your scratch directory |",
        "| `use_slurm` | `False` | `True` |",
        "",
        "| `after` | 1 | 2 |"]))
    assert parameter_table(path) == {"preset": ("tiny", "gpu-node"), "steps": (30, 200), "every": (5, 20),
                                     "sizes": ([1, 2], [1, 2, 4]), "root": ("", None), "use_slurm": (False, True)}
    assert parameter_table(_notebook(tmp_path, "| parameter | value |\n|---|---|\n| `a` | 1 |")) == {}
    assert parameter_table(path, column="one GPU") == {}  # a table without that column


def test_the_table_parser_reads_a_further_column(tmp_path):
    path = _notebook(tmp_path, "\n".join([
        "| parameter | CPU default | GPU node | one GPU |",
        "|---|---|---|---|",
        "| `workers` | 2 | 4 | 2 (they share the GPU) |",
        "| `use_slurm` | `False` | `True` | off: no cluster |",
        "| `steps`, `every` | 30, 5 | 200, 20 | 60, 10 |"]))
    assert parameter_table(path) == {"workers": (2, 4), "use_slurm": (False, True), "steps": (30, 200),
                                     "every": (5, 20)}
    assert parameter_table(path, column="one GPU") == {"workers": (2, 2), "use_slurm": (False, None),
                                                       "steps": (30, 60), "every": (5, 10)}
    assert parameter_table(tmp_path / "missing.ipynb") == {}


def test_lab01_quotes_the_gpu_checks_reference_results():
    """Lab 01's transformer section and its GPU column quote bench/gpu/<device>/gpt.json (the GPU check's reference
    results) with the device and the date: a new reference run must be quoted anew, not left stale."""
    from scalelab.experiments.single_device import gpt_reference
    refs = [r for r in gpt_reference(ROOT / "bench" / "gpu") if r["size"]["preset"] == "100m"]
    assert refs, "no 100m reference results under bench/gpu"
    nb = json.loads((ROOT / "labs" / "01_single_device" / "lab.ipynb").read_text())
    text = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown")
    quoted = [r for r in refs if r["device_name"] in text and r["date"] in text]
    assert quoted, f"lab 01 quotes none of {[(r['device_name'], r['date']) for r in refs]}"
    for ref in quoted:
        f32, b16, b16c = (ref["modes"][m]["tokens_per_s"] for m in ("fp32", "bf16", "bf16-compile"))
        for figure in (f"{f32:,.0f}", f"{b16:,.0f}", f"{b16c:,.0f}", f"{b16 / f32:.1f}×", f"{b16c / b16:.2f}×"):
            assert figure in text, f"lab 01 does not quote {figure} of {ref['file']}"
