"""A lab folder as the grader and the release see it: `lab.yaml` settings, where things are, which files are private.

    labs/NN_topic/
      lab.ipynb          reference notebook with solutions; first code cell tagged `parameters`
      checks.py          public checks (students run them with SelfCheck)
      hidden_checks.py   hidden checks: never copied to students, never shown in feedback
      lab.yaml           title, minutes, goals, grading: {parameters, cell_timeout_s, total_timeout_s, memory_mb}
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ScalelabError

NOTEBOOK, CHECKS, HIDDEN_CHECKS, SETTINGS = "lab.ipynb", "checks.py", "hidden_checks.py", "lab.yaml"
PRIVATE = ("hidden_checks.py", "hidden_*", "*_hidden.py", "solutions", "__pycache__", ".ipynb_checkpoints",
           "*.pyc", ".*")
"""Names never copied to a student (release) nor into a grading working copy; matched against every path part."""


class GradingError(ScalelabError):
    """A lab, a submission list or a grading option is wrong; the message names it and what to do."""


@dataclass
class GradingSettings:
    """The `grading:` block of lab.yaml: how a submission of this lab is executed."""

    parameters: dict[str, Any] = field(default_factory=dict)
    """Injected into the notebook's `parameters` cell (small sizes, so grading is quick)."""
    cell_timeout_s: float = 120.0
    """Longest a single cell may run."""
    total_timeout_s: float = 600.0
    """Longest the whole notebook may run, kernel start included."""
    memory_mb: int | None = 4096
    """Memory limit of a submission's run (None: no limit)."""
    network: bool = False
    """Whether a submission may use the network (labs never need it: data is generated or shipped)."""
    reverify_runs: int = 1
    """How many of the engine runs behind a submission's points the grader re-runs itself, outside the notebook,
    with the grading's nonce (grade/reverify.py); 0 switches re-verification off for this lab."""
    reverify_steps: int = 3
    """Steps each re-run trains; their losses must equal the run's own."""
    reverify_timeout_s: float = 120.0
    """Longest all re-runs of one submission may take together."""


@dataclass
class Lab:
    """One lab folder and its settings."""

    path: Path
    name: str
    title: str
    minutes: int | None = None
    goals: list[str] = field(default_factory=list)
    grading: GradingSettings = field(default_factory=GradingSettings)
    profiles: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Named parameter sets from lab.yaml's `profiles:` (e.g. laptop, gpu-node, demo); see `profile()`."""

    def profile(self, name: str) -> dict[str, Any]:
        """The parameters of profile `name`: 'ci' is grading.parameters (what the grader, the site and CI use),
        'laptop' the notebook's own defaults unless lab.yaml says otherwise, the rest from lab.yaml."""
        if name == "ci":
            return dict(self.grading.parameters)
        if name in self.profiles:
            return dict(self.profiles[name])
        if name == "laptop":
            return {}
        raise GradingError(f"{self.name}: no parameter profile {name!r}; this lab has "
                           f"{sorted({'ci', 'laptop', *self.profiles})} (profiles: in {self.path / SETTINGS})")

    @property
    def notebook(self) -> Path:
        """The reference notebook."""
        return self.path / NOTEBOOK

    @property
    def has_hidden_checks(self) -> bool:
        """Whether the lab has hidden checks."""
        return (self.path / HIDDEN_CHECKS).exists()


def load_lab(lab_dir: str | Path) -> Lab:
    """Read a lab folder (lab.yaml is optional: defaults apply); GradingError names a bad field."""
    path = Path(lab_dir).resolve()
    if path.is_file() and path.name == NOTEBOOK:
        path = path.parent
    if not (path / NOTEBOOK).is_file():
        raise GradingError(f"{path} is not a lab folder: it has no {NOTEBOOK}")
    data = _read_yaml(path / SETTINGS)
    grading = data.get("grading") or {}
    if not isinstance(grading, dict):
        raise GradingError(f"{path / SETTINGS}: 'grading' must be a mapping, got {grading!r}")
    known = set(GradingSettings.__dataclass_fields__)
    unknown = sorted(set(grading) - known)
    if unknown:
        raise GradingError(f"{path / SETTINGS}: unknown grading field(s) {unknown}; known: {sorted(known)}")
    settings = GradingSettings(**grading)
    _validate(settings, path / SETTINGS)
    goals = data.get("goals") or []
    profiles = data.get("profiles") or {}
    if not isinstance(profiles, dict) or not all(isinstance(k, str) and isinstance(v, dict)
                                                 for k, v in profiles.items()):
        raise GradingError(f"{path / SETTINGS}: 'profiles' must map names to parameter mappings, e.g. "
                           "profiles: {demo: {steps: 200}}")
    if "ci" in profiles:
        raise GradingError(f"{path / SETTINGS}: profile 'ci' is grading.parameters; set those there")
    return Lab(path, path.name, str(data.get("title") or path.name), data.get("minutes"),
               list(goals) if isinstance(goals, list) else [str(goals)], settings, profiles)


def _read_yaml(path: Path) -> dict:
    if not path.exists():
        return {}
    import yaml
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as e:
        raise GradingError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise GradingError(f"{path}: expected a mapping at the top, got {type(data).__name__}")
    return data


def _validate(s: GradingSettings, where: Path) -> None:
    if not isinstance(s.parameters, dict):
        raise GradingError(f"{where}: grading.parameters must be a mapping, got {s.parameters!r}")
    for name in ("reverify_runs", "reverify_steps"):
        value = getattr(s, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0 or (name == "reverify_steps" and value < 1):
            raise GradingError(f"{where}: grading.{name} must be a whole number >= "
                               f"{1 if name == 'reverify_steps' else 0}, got {value!r}")
    for name in ("cell_timeout_s", "total_timeout_s", "reverify_timeout_s"):
        value = getattr(s, name)
        if not isinstance(value, (int, float)) or value <= 0:
            raise GradingError(f"{where}: grading.{name} must be a number of seconds > 0, got {value!r}")
    if s.memory_mb is not None and (not isinstance(s.memory_mb, int) or s.memory_mb < 64):
        raise GradingError(f"{where}: grading.memory_mb must be an integer >= 64 (MiB) or null, got {s.memory_mb!r}")


def is_private(relpath: str | Path) -> bool:
    """Whether a path inside a lab folder must stay with the instructor (see PRIVATE)."""
    return any(fnmatch.fnmatch(part, pattern) for part in Path(relpath).parts for pattern in PRIVATE)


def cell_source(cell: dict) -> str:
    """A notebook cell's source as one string (nbformat allows a list of lines; a student's file may hold other
    things in that list, which are skipped)."""
    src = cell.get("source", "")
    return "".join(x for x in src if isinstance(x, str)) if isinstance(src, list) else str(src)


def parameter_defaults(notebook: str | Path) -> dict[str, Any]:
    """Literal defaults of the cell tagged `parameters` ({} when there is none or it is not plain literals)."""
    import ast
    import json
    try:
        nb = json.loads(Path(notebook).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    for cell in nb.get("cells", []):
        if "parameters" not in cell.get("metadata", {}).get("tags", []):
            continue
        source = cell_source(cell)
        out = {}
        try:
            tree = ast.parse(source)
        except SyntaxError:
            return {}
        for node in tree.body:
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                try:
                    out[node.targets[0].id] = ast.literal_eval(node.value)
                except ValueError:
                    continue
        return out
    return {}


def parameter_table(notebook: str | Path, column: str = "GPU node") -> dict[str, tuple[Any, Any]]:
    """The notebook's table of CPU and GPU parameters ({name: (cpu value, value in `column`)}), read from the
    markdown table whose header is `| parameter | CPU default | GPU node |`, optionally with more columns after
    those (e.g. `| one GPU |`, the hub's one-GPU profile gpu-1); {} when there is none or it lacks `column`.

    A row names one or more parameters in backticks (`` `a`, `b` ``) and gives their values as Python literals,
    comma-separated for several; a trailing remark in parentheses is ignored. A value that is not a literal (e.g.
    "your scratch directory") is given as None: the table describes it, a profile cannot hold it."""
    import ast
    import json
    import re
    try:
        nb = json.loads(Path(notebook).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}

    def values(cell: str, n: int) -> list:
        text = re.sub(r"\s*\([^()]*\)\s*$", "", cell.replace("`", "").strip())
        try:
            got = ast.literal_eval(f"[{text}]") if n > 1 else [ast.literal_eval(text)]
        except (ValueError, SyntaxError):
            return [None] * n
        return list(got) if len(got) == n else [None] * n

    for cell in nb.get("cells", []):
        if cell.get("cell_type") != "markdown":
            continue
        lines = cell_source(cell).split("\n")
        for i, line in enumerate(lines):
            header = [c.strip() for c in line.strip().strip("|").split("|")]
            if header[:3] != ["parameter", "CPU default", "GPU node"]:
                continue
            if column not in header[2:]:
                return {}
            at = header.index(column, 2)
            out = {}
            for row in lines[i + 2:]:
                cells = [c.strip() for c in row.strip().strip("|").split("|")] if row.strip().startswith("|") else []
                if len(cells) != len(header):
                    break
                names = re.findall(r"`([A-Za-z_]\w*)`", cells[0])
                for name, cpu, gpu in zip(names, values(cells[1], len(names)), values(cells[at], len(names))):
                    out[name] = (cpu, gpu)
            return out
    return {}


def run_output_dir(lab_dir: str | Path) -> Path | None:
    """The folder (relative to the lab) where the notebook writes its runs: the `out_dir` parameter's default."""
    value = parameter_defaults(Path(lab_dir) / NOTEBOOK).get("out_dir")
    if not isinstance(value, str) or not value or Path(value).is_absolute() or ".." in Path(value).parts:
        return None
    return Path(value)


def student_files(lab_dir: str | Path) -> list[Path]:
    """Files of a lab a student may have (relative, sorted): private names, symbolic links and the outputs of
    the instructor's own runs (the `out_dir` folder) left out."""
    root = Path(lab_dir)
    runs = run_output_dir(root)
    out = []
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if path.is_symlink() or not path.is_file() or is_private(rel):
            continue
        if runs is not None and (rel == runs or runs in rel.parents):
            continue
        out.append(rel)
    return out


def find_labs(labs_root: str | Path) -> list[Path]:
    """Lab folders under `labs_root` (those holding a lab.ipynb), sorted by name."""
    return sorted(p.parent for p in Path(labs_root).glob(f"*/{NOTEBOOK}") if not is_private(p.parent.name))


__all__ = ["GradingError", "GradingSettings", "Lab", "load_lab", "is_private", "student_files", "find_labs",
           "parameter_defaults", "parameter_table", "run_output_dir",
           "NOTEBOOK", "CHECKS", "HIDDEN_CHECKS", "SETTINGS", "PRIVATE"]
