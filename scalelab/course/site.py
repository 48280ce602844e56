"""Build the course website: execute each lab once (cached by content), render its page, run Sphinx.

    scalelab site build                         # labs/*/ -> build/executed/<lab>/ -> site/_build/html
    from scalelab.course.site import build_site
    report = build_site()                       # SiteReport: where the HTML is, which labs ran or were reused

1. Execute (`course/executed.py`). Each lab's reference notebook runs with its lab.yaml grading parameters and
   limits in a working copy, `build/executed/<lab>/` (runs, figures and traces land there, never in labs/).
   `executed.json` beside it keeps the hash of the lab's files (hidden checks and past runs left out); a later
   build with the same hash reuses the executed notebook instead of running it again (`force=True` runs it
   anyway). A lab that fails is reported with its name, the failing cell and the executed copy, after the other
   labs have run.
2. Stage. `site/` is copied to `build/site/src/` (the landing page's list of labs written from every lab's lab.yaml
   at its LABS_MARKER line, so it names each lab the course has, published in this build or not) with, per lab,
   `labs/<lab>.ipynb`: the executed notebook with every exercise solution replaced by `# YOUR CODE HERE` (outputs
   kept, so the page shows the plots but not the answers), papermill's injected cell, `record()` outputs and widget
   views removed; `_student/<lab>.zip`: the student copy (`scalelab labs release`); `labs/index.md` and `_labs.json`
   (what the `{lab}` role in site pages links to); with `--leaderboard`, `leaderboard.md`: a graded capstone's board
   under pseudonyms (the rows made by the CLI: this wing reads no grades).
   Unchanged files are not rewritten, so Sphinx rebuilds only what changed.
3. Sphinx (myst-nb reads the notebooks, no execution) with warnings as errors into `site/_build/html`.
"""
from __future__ import annotations

import copy
import fcntl
import html
import io
import json
import subprocess
import sys
import tempfile
import time
import zipfile
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from .executed import (EXECUTED, STAMP, ExecutedLab, LabExecutionFailed, SiteBuildError, _read_stamp,
                       _write_if_changed, ensure_executed, lab_hash, measured_on)
from .lab import NOTEBOOK, Lab, cell_source, find_labs, load_lab
from .release import release_lab
from .solutions import replace_solutions
from ..paths import checkout_root

ROOT = checkout_root()
SITE_SRC = ROOT / "site"
HTML_OUT = SITE_SRC / "_build" / "html"
STAGE = ROOT / "build" / "site"
"""Part of every lab hash: bump it when the way labs are executed changes, so old copies are not reused."""
HIDDEN = "# YOUR CODE HERE"
RECORD_MIME = "application/vnd.scalelab.record+json"
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
DROP_TAGS = {"papermill-error-cell-tag"}  # papermill's injected cell stays: it shows what the page ran with
RUN_METADATA = ("papermill", "execution", "scalelab", "widgets")
LABS_MARKER = "<!-- scalelab: the list of labs, written here by `scalelab site build` from labs/*/lab.yaml -->"
"""The line of site/index.md that the build replaces with the list of every lab (a hand-written list there once named
6 labs of 10: the labs written after it never appeared on the landing page)."""


@dataclass
class SiteReport:
    """What `build_site` did."""

    html: Path
    labs: list[ExecutedLab] = field(default_factory=list)
    sphinx_s: float = 0.0


def hide_solutions(source: str, where: str = "cell") -> tuple[str, int]:
    """`source` with each `# BEGIN SOLUTION` ... `# END SOLUTION` block replaced by one `# YOUR CODE HERE` line."""
    return replace_solutions(source, [HIDDEN], where, SiteBuildError)


def lab_page(executed: dict, lab: Lab, download: str | None = None, stamp: dict | None = None) -> dict:
    """The notebook a lab's page is rendered from: solutions hidden, outputs kept, grader plumbing removed."""
    nb = copy.deepcopy(executed)
    cells = []
    for index, cell in enumerate(nb.get("cells", [])):
        meta = cell.setdefault("metadata", {})
        if DROP_TAGS & set(meta.get("tags", [])):
            continue
        for key in RUN_METADATA:
            meta.pop(key, None)
        if cell.get("cell_type") == "code":
            source = cell_source(cell)
            cell["source"], _ = hide_solutions(source, f"{lab.name}/{NOTEBOOK}: cell {index} (id {cell.get('id')!r})")
            cell["outputs"] = [o for o in map(_page_output, cell.get("outputs", [])) if o is not None]
        cells.append(cell)
    nb["cells"] = _with_note(cells, _note(lab, download, stamp or {}))
    for key in RUN_METADATA:
        nb.setdefault("metadata", {}).pop(key, None)
    return nb


def _page_output(output: dict) -> dict | None:
    """An output as the page shows it: records (the grader's channel) dropped, widget views left to their text."""
    data = output.get("data")
    if data is None:
        return output
    if RECORD_MIME in data:
        return None
    if WIDGET_MIME in data:
        data = {k: v for k, v in data.items() if k != WIDGET_MIME}
        if not data:
            return None
        output["data"] = data
    return output


def _executed_how(stamp: dict) -> str:
    by = stamp.get("executed_by")
    return f"by {by}" if isinstance(by, str) and by else "when the site was built"


def _note(lab: Lab, download: str | None, stamp: dict | None = None) -> str:
    params = ", ".join(f"`{k}={json.dumps(v)}`" for k, v in lab.grading.parameters.items()) or "its defaults"
    lines = [":::{note}",
             f"**Time:** about {lab.minutes} minutes." if lab.minutes else "",
             f"This page is the reference notebook, executed on a CPU {_executed_how(stamp or {})}, with the small "
             f"parameters the course's tests use ({params}). The exercise solutions are replaced by "
             f"`{HIDDEN}`; their outputs are left in, so you can compare your numbers.",
             f"{{download}}`Download the lab <{download}>` (notebook and self-checks) or open it on the course hub; "
             "[Setup](../setup.md) says how." if download else "[Setup](../setup.md) says how to run it yourself.",
             measured_on(stamp or {}),
             ":::"]
    return "\n".join(line for line in lines if line) + "\n"


def _with_note(cells: list[dict], note: str) -> list[dict]:
    """Put `note` right under the notebook's title (or first, when it has none)."""
    note_cell = {"cell_type": "markdown", "id": "scalelab-site-note", "metadata": {}, "source": note}
    if cells and cells[0].get("cell_type") == "markdown":
        first = cell_source(cells[0])
        title, sep, rest = first.partition("\n")
        if title.startswith("# "):
            head = {**cells[0], "source": title + "\n"}
            tail = [{**cells[0], "id": f"{cells[0].get('id', 'intro')}-body", "source": rest}] if rest.strip() else []
            return [head, note_cell, *tail, *cells[1:]]
    return [note_cell, *cells]


def student_zip(lab_dir: Path) -> bytes:
    """The student copy of a lab (`scalelab labs release`) as a zip with fixed timestamps (same lab, same bytes)."""
    with tempfile.TemporaryDirectory(prefix="scalelab-site-") as tmp:
        out = Path(tmp) / lab_dir.name
        release_lab(lab_dir, out)
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
            for path in sorted(p for p in out.rglob("*") if p.is_file()):
                info = zipfile.ZipInfo(f"{lab_dir.name}/{path.relative_to(out).as_posix()}", (2020, 1, 1, 0, 0, 0))
                info.external_attr = 0o644 << 16
                zf.writestr(info, path.read_bytes(), zipfile.ZIP_DEFLATED)
        return buf.getvalue()


def stage(site_src: Path, stage_dir: Path, labs: list[tuple[Lab, Path]], listed: list[Lab] | None = None,
          leaderboard: dict | None = None) -> Path:
    """Write the Sphinx source tree: site/ plus one page and one download per (lab, executed notebook). The landing
    page lists the labs `listed` (default: those staged), linking those staged. `leaderboard` ({"lab", "rows"}:
    pseudonymised rows) adds `leaderboard.md`, linked from the labs' overview."""
    src = stage_dir / "src"
    wanted: set[Path] = set()
    published = {lab.name for lab, _ in labs}
    listed = [lab for lab, _ in labs] if listed is None else listed

    def put(rel: str | Path, content: str | bytes) -> None:
        wanted.add(src / rel)
        _write_if_changed(src / rel, content)

    for path in sorted(site_src.rglob("*")):
        rel = path.relative_to(site_src)
        if path.is_file() and rel.parts[0] != "_build" and "__pycache__" not in rel.parts:
            content = path.read_bytes()
            if rel == Path("index.md"):
                content = landing_page(content.decode("utf-8"), listed, published)
            put(rel, content)
    entries = {}
    for lab, executed in labs:
        download = f"../_student/{lab.name}.zip"
        put(f"_student/{lab.name}.zip", student_zip(lab.path))
        page = lab_page(json.loads(executed.read_text(encoding="utf-8")), lab, download,
                        _read_stamp(executed.parent / STAMP))
        put(f"labs/{lab.name}.ipynb", json.dumps(page, indent=1, ensure_ascii=False) + "\n")
        entries[lab.name.split("_")[0]] = {"doc": f"labs/{lab.name}", "title": lab.title, "minutes": lab.minutes}
    if leaderboard is not None:
        put("leaderboard.md", leaderboard_page(leaderboard["rows"], leaderboard["lab"]))
    put("labs/index.md", labs_index([lab for lab, _ in labs], board=leaderboard is not None))
    put("_labs.json", json.dumps(entries, indent=1, sort_keys=True) + "\n")
    for path in sorted(src.rglob("*"), reverse=True):  # a page removed from site/ or a lab removed from labs/
        if path.is_file() and path not in wanted:
            path.unlink()
        elif path.is_dir() and not any(path.iterdir()):
            path.rmdir()
    return src


def landing_page(text: str, labs: list[Lab], published: set[str]) -> str:
    """The landing page's Markdown with its LABS_MARKER line replaced by a numbered list of `labs`: number, title
    (a link where the lab is in `published`) and time. Without the marker the page is left as it is."""
    if LABS_MARKER not in text:
        return text
    items = []
    for i, lab in enumerate(labs, 1):
        number = lab.name.split("_")[0]
        head, _, rest = lab.title.partition(": ")
        title = f"**{head}**" + (f": {rest}" if rest else "")
        link = f" ([Lab {number}](labs/{lab.name}.ipynb))" if lab.name in published else " (not on this site yet)"
        minutes = f", about {lab.minutes} minutes" if lab.minutes else ""
        items.append(f"{i}. {title}{link}{minutes}.")
    listing = "\n".join(items) if items else "No labs are published yet."
    return "\n".join(listing if line.strip() == LABS_MARKER else line for line in text.split("\n"))


def labs_index(labs: list[Lab], board: bool = False) -> str:
    """The labs overview page (Markdown): a table with time and goals, and the toctree of lab pages; `board`: a link
    to the capstone's leaderboard page."""
    lines = ["# Labs", "",
             "Each lab is a Jupyter notebook: teaching text, short cells that call the `scalelab` library, exercises "
             "and self-checks. The pages below show each lab executed on a CPU at small sizes, with its plots; the "
             "exercise solutions are hidden. Run them yourself on a laptop or on the course hub "
             "([Setup](../setup.md)).", ""]
    if not labs:
        lines += ["No labs are published yet.", ""]
    else:
        lines += ["| | Lab | Time | You will |", "|---|---|---|---|"]
        for lab in labs:
            goals = "; ".join(_lower_first(g.rstrip(".")) for g in lab.goals[:3])
            goals += "; ..." if len(lab.goals) > 3 else ""
            minutes = f"{lab.minutes} min" if lab.minutes else ""
            lines.append(f"| {lab.name.split('_')[0]} | [{lab.title}]({lab.name}.ipynb) | {minutes} | {goals} |")
        lines.append("")
    if board:
        lines += ["The capstone's class challenge: [the leaderboard](../leaderboard.md).", ""]
    lines += ["```{toctree}", ":hidden:", ":maxdepth: 1", "", *[lab.name for lab in labs], "```", ""]
    return "\n".join(lines)


def _cell(value) -> str:
    """`value` as text inside the raw HTML of a page: escaped, on one line, no backtick (it cannot end the block)."""
    return html.escape(" ".join(str(value).split())[:300]).replace("`", "&#96;")


def _seconds(value) -> str:
    return "–" if value is None else f"{value:,.1f} s"


def leaderboard_table(rows: list[dict]) -> str:
    """The capstone's board as one line of HTML (`grade.leaderboard.standings` rows, names already as they may be
    shown): every value escaped (student names, choices and reasons come from students' submissions); a row with
    "you" set is marked. The dashboard and the site draw the same table."""
    head = ("place", "student", "time to target", "held-out accuracy", "rank-seconds / budget",
            "lost to the injected failure", "choices", "note")
    body = []
    for r in rows:
        acc = r.get("accuracy")
        used, budget = r.get("rank_seconds"), r.get("budget_rank_s")
        cells = [_cell(r.get("place") or "–"),
                 _cell(r.get("student", "")) + (" <strong class='you'>you</strong>" if r.get("you") else ""),
                 _seconds(r.get("time_to_target_s")) if r.get("ranked") else "–",
                 "–" if acc is None else f"{100 * acc:.1f} %" if acc <= 1 else f"{acc:g}",
                 ("–" if used is None else f"{used:,.0f}") + (f" / {budget:,.0f}" if budget is not None else ""),
                 _seconds(r.get("lost_s")),
                 _cell(", ".join(f"{k}={v}" for k, v in (r.get("choices") or {}).items())),
                 _cell(r.get("why") or ("" if r.get("ranked") else "not ranked"))]
        kind = "you" if r.get("you") else "ranked" if r.get("ranked") else "unranked"
        body.append(f"<tr class='{kind}'>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    return ("<table id='leaderboard'><thead><tr>" + "".join(f"<th>{h}</th>" for h in head) + "</tr></thead><tbody>"
            + "".join(body) + "</tbody></table>")


def leaderboard_page(rows: list[dict], lab: str) -> str:
    """The site's leaderboard page (Markdown with the table as raw HTML; not in a toctree: linked from the labs'
    overview). `rows` must already be pseudonymised (`scalelab.hub.capstone.public_rows`)."""
    return ("---\norphan: true\n---\n\n# Capstone leaderboard\n\n"
            f"The class challenge of {_cell(lab)}, as the grader measured it after the deadline: time to the target "
            "accuracy on the held-out set, within the rank-seconds budget, an injected failure included. Names are "
            "pseudonyms; yours is on your dashboard's board while the challenge is open.\n\n"
            f"```{{raw}} html\n{leaderboard_table(rows)}\n```\n")


def _lower_first(text: str) -> str:
    """'Measure X' -> 'measure X' (a goal inside a sentence); 'DDP ...' stays."""
    return text[:1].lower() + text[1:] if text[1:2].islower() else text


def run_sphinx(src: Path, out: Path, doctrees: Path) -> float:
    """sphinx-build (HTML, warnings are errors) from `src` into `out`; SiteBuildError with Sphinx's messages."""
    start = time.monotonic()
    cmd = [sys.executable, "-m", "sphinx", "-b", "html", "-q", "-W", "--keep-going", "-d", str(doctrees),
           str(src), str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SiteBuildError(f"sphinx-build failed (exit {proc.returncode}); the page named in each message is "
                             f"under {src} (site/ or a generated lab page):\n{(proc.stderr or proc.stdout)[-6000:]}")
    return time.monotonic() - start


def build_site(labs_root: str | Path | None = None, site_src: str | Path = SITE_SRC, out: str | Path = HTML_OUT,
               executed_root: str | Path = EXECUTED, stage_dir: str | Path = STAGE, only: list[str] | None = None,
               force: bool = False, progress: Callable[[str], None] = lambda msg: None,
               leaderboard: dict | None = None) -> SiteReport:
    """Execute (or reuse) every lab, stage the pages and build the HTML; see the module docstring. `leaderboard`:
    {"lab", "rows"} of a graded capstone, pseudonymised (`scalelab site build --leaderboard`), adds its page."""
    labs_root = Path(labs_root) if labs_root else ROOT / "labs"
    site_src, out, stage_dir = Path(site_src), Path(out), Path(stage_dir)
    if not (site_src / "conf.py").is_file():
        raise SiteBuildError(f"{site_src} has no conf.py: it is not the site's Sphinx source")
    dirs = find_labs(labs_root)
    if only:
        unknown = sorted(set(only) - {d.name for d in dirs})
        if unknown:
            raise SiteBuildError(f"no lab(s) {unknown} under {labs_root}; labs there: {[d.name for d in dirs]}")
        dirs = [d for d in dirs if d.name in only]
    with _lock(stage_dir.parent / f".{stage_dir.name}.lock"):
        report, failures, staged = SiteReport(out), {}, []
        for d in dirs:
            progress(f"lab {d.name}: executing (or reusing an up-to-date copy)")
            try:
                done = ensure_executed(d, executed_root, force)
            except LabExecutionFailed as e:
                failures.update(e.failures)
                progress(f"lab {d.name}: FAILED")
                continue
            how = "reused (it had executed in" if done.reused else "executed (in"
            progress(f"lab {d.name}: {how} {done.duration_s:.0f} s)")
            report.labs.append(done)
            staged.append((load_lab(d), done.notebook))
        if failures:
            raise LabExecutionFailed(failures)
        src = stage(site_src, stage_dir, staged, [load_lab(d) for d in find_labs(labs_root)], leaderboard)
        progress(f"sphinx: {src} -> {out}")
        report.sphinx_s = run_sphinx(src, out, stage_dir / "doctrees")
    return report


@contextmanager
def _lock(path: Path):
    """One build at a time in a checkout (engineers and a test may build at once)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def report_dict(report: SiteReport) -> dict:
    """The report as JSON data (`scalelab site build --json`)."""
    return {"html": str(report.html), "sphinx_s": round(report.sphinx_s, 1),
            "labs": [{**asdict(lab), "notebook": str(lab.notebook)} for lab in report.labs]}


__all__ = ["SiteBuildError", "LabExecutionFailed", "ExecutedLab", "SiteReport", "lab_hash", "ensure_executed",
           "hide_solutions", "lab_page", "student_zip", "stage", "landing_page", "labs_index", "run_sphinx",
           "leaderboard_table", "leaderboard_page",
           "build_site",
           "report_dict", "SITE_SRC", "HTML_OUT", "EXECUTED", "STAGE", "HIDDEN", "LABS_MARKER"]
