"""The shape of the house (docs/architecture.md): imports run one way between the wings, no module imports itself
back through a circle, no private name crosses a package, the top of scalelab/ holds only the ground modules, and
labs import only the public facade. Read from the source with `ast`, so every lazy import inside a function counts.
"""
from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# wing -> the wings it may import. Ground modules (errors, paths, dist, machine, record) may be imported by everyone.
GROUND = {"errors", "paths", "dist", "machine", "record"}
ALLOWED = {
    "ground": set(),
    "run": set(),
    "cluster": {"run"},
    "data": {"run"},
    "ckpt": {"run"},
    "train": {"run", "data", "ckpt"},
    "launch": {"run", "cluster"},
    "experiments": {"run", "cluster", "data", "ckpt", "train", "launch"},
    "course": {"run"},
    "grade": {"run", "course", "cluster"},  # cluster: grade --slurm submits each submission's job (slurm_grading)
    "hub": {"run", "cluster", "course", "grade"},
    "testing": {"run", "cluster", "course", "grade", "hub"},
    "cli": {"run", "cluster", "data", "ckpt", "train", "launch", "experiments", "course", "grade", "hub"},
    "widgets": {"run", "cluster", "data", "ckpt", "train", "launch", "experiments", "course", "grade"},
    "facade": None,  # scalelab/__init__.py names what notebooks use, wherever it lives (loaded lazily)
    "alias": {"train"},  # scalelab/worker.py: `python -m scalelab.worker` for old batch scripts
}
TOP_LEVEL = {"__init__.py", "errors.py", "paths.py", "dist.py", "machine.py", "record.py", "worker.py"}
LAB_IMPORTS = re.compile(r"scalelab(\.widgets|\.experiments(\.\w+)?|\.record)?")


def modules() -> dict[str, Path]:
    """Every module of the package (widgets included, as scalelab.widgets.*) -> its file."""
    found = {}
    for path in sorted((ROOT / "scalelab").rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    for path in sorted((ROOT / "widgets").glob("*.py")):
        name = "scalelab.widgets" + ("" if path.stem == "__init__" else "." + path.stem)
        found[name] = path
    return found


def wing(module: str) -> str:
    parts = module.split(".")
    if module == "scalelab":
        return "facade"
    if parts[1] == "worker" and len(parts) == 2:
        return "alias"
    if parts[1] in GROUND:
        return "ground"
    return parts[1]


def imports_of(module: str, path: Path) -> list[tuple[str, list[str], int]]:
    """(imported module, names imported from it, line) for every import of a scalelab module in `path`."""
    is_pkg = path.name == "__init__.py"
    package = module.split(".") if is_pkg else module.split(".")[:-1]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            if base.split(".")[0] == "scalelab":
                out.append((base, [a.name for a in node.names], node.lineno))
        elif isinstance(node, ast.Import):
            out += [(a.name, [], node.lineno) for a in node.names if a.name.split(".")[0] == "scalelab"]
    return out


def resolve(target: str, names: list[str], known: dict) -> list[str]:
    """The modules an import statement really loads: `from pkg import sub` loads pkg.sub."""
    return [f"{target}.{n}" for n in names if f"{target}.{n}" in known] or [target]


def test_imports_run_one_way_between_the_wings():
    known = modules()
    wrong = []
    for module, path in known.items():
        allowed = ALLOWED[wing(module)]
        if allowed is None:
            continue
        for target, names, line in imports_of(module, path):
            for dep in resolve(target, names, known):
                w = wing(dep)
                if w not in ("ground", wing(module)) and w not in allowed:
                    wrong.append(f"{path.relative_to(ROOT)}:{line}: {wing(module)} imports {dep} ({w})")
    assert not wrong, "imports that run back up between wings (see docs/architecture.md):\n" + "\n".join(wrong)


def test_no_module_imports_itself_back_through_a_circle():
    known = modules()
    graph = {m: {d for t, names, _ in imports_of(m, p) for d in resolve(t, names, known) if d in known and d != m}
             for m, p in known.items() if wing(m) != "facade"}
    for deps in graph.values():  # importing a.b.c runs a.b first: a package's __init__ is never a real edge back
        deps -= {d for d in deps if wing(d) == "facade"}
    circles, state = [], {}

    def visit(node, stack):
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                circles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not circles, "import circles:\n" + "\n".join(circles)


def test_no_private_name_is_imported_across_packages():
    known = modules()
    wrong = []
    for module, path in known.items():
        package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
        for target, names, line in imports_of(module, path):
            target_pkg = target if (target in known and known[target].name == "__init__.py") else target.rsplit(".", 1)[0]
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            if private and target_pkg != package:
                wrong.append(f"{path.relative_to(ROOT)}:{line}: {', '.join(private)} from {target}")
    assert not wrong, "private names used from another package:\n" + "\n".join(wrong)


def test_the_top_of_the_package_holds_only_the_ground_modules():
    loose = {p.name for p in (ROOT / "scalelab").glob("*.py")} - TOP_LEVEL
    assert not loose, f"modules at the top of scalelab/ that belong in a wing: {sorted(loose)}"


def test_the_checks_above_catch_a_module_that_imports_up():
    # The rules bite: a launcher importing the grader, or the run wing importing a launcher, is refused.
    assert "grade" not in ALLOWED["launch"] and "launch" not in ALLOWED["run"]
    assert wing("scalelab.launch.slurm") == "launch" and wing("scalelab.paths") == "ground"
    assert resolve("scalelab", ["spec"], {"scalelab.spec": None}) == ["scalelab.spec"]


@pytest.mark.parametrize("lab", sorted((ROOT / "labs").glob("*/lab.ipynb")), ids=lambda p: p.parent.name)
def test_labs_import_only_the_public_facade(lab):
    wrong = []
    for index, cell in enumerate(json.loads(lab.read_text())["cells"]):
        if cell["cell_type"] != "code":
            continue
        for m in re.finditer(r"^\s*(?:from|import)\s+(scalelab[\w.]*)", "".join(cell["source"]), re.M):
            if not LAB_IMPORTS.fullmatch(m.group(1)):
                wrong.append(f"cell {index}: {m.group(0).strip()}")
    assert not wrong, (f"{lab.parent.name} imports internals; use scalelab, scalelab.widgets, scalelab.experiments "
                       "or scalelab.record:\n" + "\n".join(wrong))


def test_every_widget_the_package_lists_can_be_imported():
    import scalelab.widgets as widgets
    for name in widgets.__all__:
        assert isinstance(getattr(widgets, name), type), name


def test_the_facade_exports_what_notebooks_use():
    import scalelab
    for name in ("RunSpec", "preset", "launch", "record", "SpmdPool", "run_spmd", "ScalelabError", "submit_chain",
                 "run_in_time_slices"):
        assert getattr(scalelab, name) is not None, name
    assert scalelab.preset("tiny").launcher == "local"


def test_facade_functions_are_not_shadowed_by_subpackages_of_the_same_name():
    # `from scalelab import launch` after something imported scalelab.launch.chain (lab 06 does, first) must still
    # give the function: a fresh interpreter, in the lab's order.
    import subprocess
    import sys
    code = ("from scalelab import run_in_time_slices, submit_chain\nfrom scalelab import launch, record\n"
            "import scalelab.record, scalelab.launch.slurm\nfrom scalelab import launch as again\n"
            "print(callable(launch), callable(record), callable(again), launch.__module__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["True", "True", "True", "scalelab.launch"]


def test_modules_named_before_the_move_are_the_same_modules_now():
    # Student copies released before the wings import these; they must get the very modules that hold the code.
    import importlib

    import scalelab
    with warnings.catch_warnings():  # the old names warn: the next test holds the warning's text, in a fresh process
        warnings.simplefilter("ignore", FutureWarning)
        for old, new in scalelab.LEGACY_MODULES.items():
            assert importlib.import_module(old) is importlib.import_module(new), old
            assert importlib.import_module(new).__spec__.name == new  # the alias does not rename the real module
        from scalelab.spec import LAUNCHERS, preset  # noqa: F401  (names a pre-move lab imported)
        from scalelab.launch.spmd import SpmdPool  # noqa: F401
        from scalelab.ckpt import measure, read_manifest  # noqa: F401
        from scalelab.data import measure as data_measure  # noqa: F401
    assert measure.__name__ == "scalelab.experiments.checkpointing"
    assert data_measure.__name__ == "scalelab.experiments.data_pipeline"


def test_an_old_module_name_warns_with_the_new_name_and_the_release_that_removes_it():
    import scalelab
    code = "import scalelab.spec\nfrom scalelab.data import measure\n"
    out = subprocess.run([sys.executable, "-W", "always", "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    for old, new in (("scalelab.spec", "scalelab.run.spec"), ("scalelab.data.measure", "scalelab.experiments.data_pipeline")):
        assert (f"FutureWarning: {old} is the old name of {new}: import {new} instead ({old} goes in scalelab "
                f"{scalelab.LEGACY_REMOVED_IN})") in out.stderr, out.stderr
    assert scalelab.LEGACY_REMOVED_IN in (ROOT / "docs" / "architecture.md").read_text(), \
        "docs/architecture.md must name the release that removes the old names"


def test_nothing_but_the_legacy_fixtures_imports_an_old_module_name():
    import scalelab
    olds = sorted(scalelab.LEGACY_MODULES, key=len, reverse=True)
    dotted = re.compile(r"(?:from|import)\s+(" + "|".join(map(re.escape, olds)) + r")\b")
    parents: dict[str, set] = {}
    for old in olds:
        parent, leaf = old.rsplit(".", 1)
        parents.setdefault(parent, set()).add(leaf)
    from_parent = re.compile(r"from[ \t]+(" + "|".join(map(re.escape, parents)) + r")[ \t]+import[ \t]+"
                             r"(?:\(([^)]*)\)|([\w ,\t]+))")
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.split()
    allowed = ("tests/fixtures/legacy/", "tests/test_architecture.py")  # what they test is the old names
    found = []
    for name in files:
        if name.startswith(allowed) or not name.endswith((".py", ".ipynb", ".md", ".sh", ".j2")):
            continue
        text = (ROOT / name).read_text(errors="replace")
        found += [f"{name}: {m.group(0)}" for m in dotted.finditer(text)]
        for m in from_parent.finditer(text):
            names = {n.strip().split(" as ")[0] for n in (m.group(2) or m.group(3)).replace("\n", ",").split(",")}
            found += [f"{name}: from {m.group(1)} import {leaf}" for leaf in names & parents[m.group(1)]]
    assert len(files) > 300, "git ls-files found too few files: is this a checkout?"
    assert found == [], "old module names (scalelab.LEGACY_MODULES) outside the legacy fixtures:\n" + "\n".join(found)
