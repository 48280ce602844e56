"""The course website's build logic on the fixture lab (tests/fixtures/site/labs/01_fixture): lab pages hide the
solutions but keep the outputs, drop the grader's records, never carry hidden checks; a lab is executed once per
content hash; a failing lab is named; the CLI drives `build_site`. The last test builds the fixture site for real
(papermill + Sphinx, ~30 s); the headless-browser check of the real site is tests/test_site_browser.py."""
from __future__ import annotations

import base64
import json
import shutil
import zipfile
from pathlib import Path

import pytest

from scalelab.course import site as sb
from scalelab.course.execute import NotebookCellError, NotebookResult
from scalelab.course.lab import load_lab

FIXTURE_LABS = Path(__file__).parent / "fixtures" / "site" / "labs"
FIXTURE = FIXTURE_LABS / "01_fixture"
SOLUTION = "FIXTURE-SOLUTION-LINE"
HIDDEN = "FIXTURE-HIDDEN-7f3a"
PNG = base64.b64encode(b"\x89PNG\r\n\x1a\n not a real image: only papermill's shape matters here").decode()


def executed_copy(nb: dict) -> dict:
    """What papermill would write for the fixture: injected parameters, a plot, a record, run metadata."""
    nb = json.loads(json.dumps(nb))
    injected = {"cell_type": "code", "id": "injected", "execution_count": None, "outputs": [],
                "metadata": {"tags": ["injected-parameters"]}, "source": "# Parameters\npoints = 8\n"}
    nb["cells"].insert(2, injected)
    for cell in nb["cells"]:
        if cell["cell_type"] != "code":
            continue
        cell["metadata"]["papermill"] = {"start_time": "x", "duration": 0.1}
        if "plt.show()" in "".join(cell["source"]):
            cell["outputs"] = [{"output_type": "display_data", "metadata": {},
                                "data": {"image/png": PNG, "text/plain": "<Figure>"}}]
        if "record(" in "".join(cell["source"]) and "BEGIN SOLUTION" in "".join(cell["source"]):
            cell["outputs"] = [
                {"output_type": "stream", "name": "stdout", "text": "last = 14.0\n"},
                {"output_type": "display_data", "metadata": {},
                 "data": {sb.RECORD_MIME: {"name": "last", "value": 14.0}, "text/plain": "record: last = 14.0"}},
                {"output_type": "display_data", "metadata": {},
                 "data": {sb.WIDGET_MIME: {"model_id": "abc"}, "text/plain": "SelfCheck(...)"}}]
    nb["metadata"]["papermill"] = {"parameters": {"points": 8}}
    return nb


@pytest.fixture
def lab_copy(tmp_path):
    """A private copy of the fixture lab (tests may edit it)."""
    dst = tmp_path / "labs" / FIXTURE.name
    shutil.copytree(FIXTURE, dst)
    return dst


@pytest.fixture
def fake_execute(monkeypatch):
    """Replace papermill with a fake that writes `executed_copy` of the notebook; counts calls, can fail on demand."""
    calls, failing = [], set()

    def fake(path, parameters=None, *, output_path, cwd, cell_timeout, total_timeout, **kw):
        calls.append({"path": Path(path), "parameters": parameters, "cwd": Path(cwd), "cell_timeout": cell_timeout,
                      "total_timeout": total_timeout})
        nb = executed_copy(json.loads(Path(path).read_text()))
        Path(output_path).write_text(json.dumps(nb))
        name = Path(path).parent.name
        if name in failing:
            err = NotebookCellError(f"lab.ipynb: cell 3 raised ValueError: boom (output: {output_path})", str(path),
                                    str(output_path), ename="ValueError", evalue="boom", traceback="Traceback: boom",
                                    cell_index=3, cell_id="c3", source="raise ValueError('boom')")
            return NotebookResult(str(path), str(output_path), "cell_error", {}, 0.1, err)
        return NotebookResult(str(path), str(output_path), "ok", {}, 0.1, None)

    monkeypatch.setattr("scalelab.course.execute.execute_notebook", fake)
    fake.calls, fake.failing = calls, failing
    return fake


def test_hide_solutions_leaves_one_placeholder_line_at_the_block_indent():
    source = "x = 1\nif x:\n    # BEGIN SOLUTION\n    y = 2\n    z = 3\n    # END SOLUTION\nprint(y)\n"
    hidden, blocks = sb.hide_solutions(source)
    assert blocks == 1
    assert hidden == "x = 1\nif x:\n    # YOUR CODE HERE\nprint(y)\n"


@pytest.mark.parametrize("source, words", [
    ("# BEGIN SOLUTION\nx = 1\n", "never closed"),
    ("x = 1\n# END SOLUTION\n", "line 2: END SOLUTION without"),
    ("# BEGIN SOLUTION\n# BEGIN SOLUTION\n# END SOLUTION\n", "line 2: BEGIN SOLUTION inside"),
])
def test_unbalanced_solution_markers_stop_the_page_naming_the_cell_and_line(source, words):
    with pytest.raises(sb.SiteBuildError, match=words) as info:
        sb.hide_solutions(source, "01_x/lab.ipynb: cell 4")
    assert "01_x/lab.ipynb: cell 4" in str(info.value)


def test_lab_page_hides_solutions_keeps_outputs_and_drops_grader_plumbing():
    lab = load_lab(FIXTURE)
    executed = executed_copy(json.loads(lab.notebook.read_text()))
    page = sb.lab_page(executed, lab, "../_student/01_fixture.zip")
    text = json.dumps(page)
    assert SOLUTION not in text and sb.HIDDEN in text
    outputs = [o for c in page["cells"] if c["cell_type"] == "code" for o in c["outputs"]]
    assert any("image/png" in o.get("data", {}) for o in outputs), "the plot must stay on the page"
    assert any(o.get("text") == "last = 14.0\n" for o in outputs), "the exercise's printed output stays"
    assert sb.RECORD_MIME not in text and sb.WIDGET_MIME not in text
    assert any(o.get("data") == {"text/plain": "SelfCheck(...)"} for o in outputs), "a widget keeps its text"
    assert "papermill" not in text
    assert any("injected-parameters" in c["metadata"].get("tags", []) for c in page["cells"]), \
        "the parameters the page ran with stay visible"
    title, note = page["cells"][0], page["cells"][1]
    assert "".join(title["source"]).strip() == "# Lab 01 — Fixture: a curve and an exercise"
    assert "{download}`Download the lab <../_student/01_fixture.zip>`" in note["source"]
    assert "`points=8`" in note["source"] and "about 5 minutes" in note["source"]
    assert "A tiny lab for the site tests" in "".join(page["cells"][2]["source"])
    assert len({c["id"] for c in page["cells"]}) == len(page["cells"]), "cell ids stay unique"


def test_a_page_says_on_what_machine_and_under_what_load_it_was_measured():
    lab = load_lab(FIXTURE)
    executed = executed_copy(json.loads(lab.notebook.read_text()))
    stamp = {"machine": {"cpus": 2, "cpu_model": "Test CPU", "memory_gib": 23.4, "gpus": 0},
             "load": {"before": 0.4, "after": 5.1}, "executed_at": "2026-11-23 10:00:00 +0000"}
    note = "".join(sb.lab_page(executed, lab, None, stamp)["cells"][1]["source"])
    assert "**Measured on:** 2 CPUs (Test CPU), 23.4 GiB of memory, no GPU" in note
    assert "load average 0.4 before the run and 5.1 after" in note and "busy with other work" in note
    quiet = {**stamp, "load": {"before": 0.2, "after": 1.1}}
    assert "busy" not in "".join(sb.lab_page(executed, lab, None, quiet)["cells"][1]["source"])
    from scalelab.course.executed import machine_summary
    real = machine_summary()
    assert real["cpus"] >= 1 and real["memory_gib"] > 0


def test_a_lab_is_executed_once_per_content_and_again_when_its_files_change(lab_copy, tmp_path, fake_execute):
    executed = tmp_path / "executed"
    first = sb.ensure_executed(lab_copy, executed)
    assert not first.reused and len(fake_execute.calls) == 1
    call = fake_execute.calls[0]
    assert call["parameters"] == {"points": 8} and call["cell_timeout"] == 60 and call["total_timeout"] == 120
    assert call["cwd"] == executed / "01_fixture", "runs land in the working copy, not in labs/"
    assert (executed / "01_fixture" / "checks.py").is_file()
    assert not (executed / "01_fixture" / "hidden_checks.py").exists()

    again = sb.ensure_executed(lab_copy, executed)
    assert again.reused and again.notebook == first.notebook and len(fake_execute.calls) == 1

    (lab_copy / "hidden_checks.py").write_text("# hidden checks do not change what the page shows\n")
    assert sb.ensure_executed(lab_copy, executed).reused
    (lab_copy / "runs").mkdir()
    (lab_copy / "runs" / "old.json").write_text("{}")  # the instructor's own runs (out_dir) do not count either
    assert sb.ensure_executed(lab_copy, executed).reused

    (lab_copy / "lab.yaml").write_text((lab_copy / "lab.yaml").read_text().replace("points: 8", "points: 9"))
    changed = sb.ensure_executed(lab_copy, executed)
    assert not changed.reused and fake_execute.calls[-1]["parameters"] == {"points": 9}
    assert sb.ensure_executed(lab_copy, executed, force=True).reused is False
    assert len(fake_execute.calls) == 3


def test_a_notebook_executed_elsewhere_is_adopted_until_the_lab_changes(lab_copy, tmp_path, fake_execute):
    # the test suite's grader runs each reference in its sandbox; the site shows that run instead of a third one
    from scalelab.course.executed import adopt_executed
    executed, lab = tmp_path / "executed", load_lab(lab_copy)
    graded = executed_copy(json.loads(lab.notebook.read_text()))
    adopted = adopt_executed(lab_copy, graded, 12.3, "the grader", executed)
    assert json.loads(adopted.notebook.read_text()) == graded
    done = sb.ensure_executed(lab_copy, executed)
    assert done.reused and done.duration_s == 12.3 and fake_execute.calls == []
    stamp = json.loads((executed / "01_fixture" / sb.STAMP).read_text())
    assert stamp["executed_by"] == "the grader" and stamp["parameters"] == {"points": 8}
    note = "".join(sb.lab_page(graded, lab, None, stamp)["cells"][1]["source"])
    assert "executed on a CPU by the grader" in note and "when the site was built" not in note
    (lab_copy / "lab.yaml").write_text((lab_copy / "lab.yaml").read_text().replace("points: 8", "points: 9"))
    assert not sb.ensure_executed(lab_copy, executed).reused and len(fake_execute.calls) == 1


def test_a_failing_lab_is_named_with_its_cell_and_the_other_labs_still_run(lab_copy, tmp_path, fake_execute,
                                                                           monkeypatch):
    second = lab_copy.parent / "02_other"
    shutil.copytree(lab_copy, second)
    fake_execute.failing.add("01_fixture")
    monkeypatch.setattr(sb, "run_sphinx", lambda *a: pytest.fail("Sphinx must not run after a lab failed"))
    with pytest.raises(sb.LabExecutionFailed) as info:
        sb.build_site(lab_copy.parent, out=tmp_path / "html", executed_root=tmp_path / "executed",
                      stage_dir=tmp_path / "stage")
    message = str(info.value)
    assert "1 lab(s) failed to execute: 01_fixture" in message
    assert "ValueError: boom" in message and "raise ValueError('boom')" in message
    assert list(info.value.failures) == ["01_fixture"]
    assert [c["path"].parent.name for c in fake_execute.calls] == ["01_fixture", "02_other"]
    assert not (tmp_path / "executed" / "01_fixture" / sb.STAMP).exists(), "a failed run is never reused"
    assert (tmp_path / "executed" / "02_other" / sb.STAMP).exists()


def test_unknown_lab_name_is_refused_with_the_labs_that_exist(tmp_path):
    with pytest.raises(sb.SiteBuildError, match=r"no lab\(s\) \['09_nope'\].*01_fixture"):
        sb.build_site(FIXTURE_LABS, out=tmp_path / "html", stage_dir=tmp_path / "stage", only=["09_nope"])


def test_staged_source_has_pages_and_downloads_but_no_hidden_checks_or_solutions(lab_copy, tmp_path, fake_execute):
    done = sb.ensure_executed(lab_copy, tmp_path / "executed")
    lab = load_lab(lab_copy)
    src = sb.stage(sb.SITE_SRC, tmp_path / "stage", [(lab, done.notebook)])
    assert (src / "conf.py").is_file() and (src / "labs" / "01_fixture.ipynb").is_file()
    assert json.loads((src / "_labs.json").read_text())["01"] == {
        "doc": "labs/01_fixture", "title": lab.title, "minutes": 5}
    assert ("| 01 | [Fixture: a curve and an exercise](01_fixture.ipynb) | 5 min | see a plot on the page; not see the "
            "solution |") in (src / "labs" / "index.md").read_text()
    for path in src.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            assert HIDDEN.encode() not in data and SOLUTION.encode() not in data, path
    with zipfile.ZipFile(src / "_student" / "01_fixture.zip") as zf:
        assert sorted(zf.namelist()) == ["01_fixture/checks.py", "01_fixture/lab.ipynb", "01_fixture/lab.yaml"]
        student = json.loads(zf.read("01_fixture/lab.ipynb"))
        assert 'raise NotImplementedError("exercise")' in json.dumps(student, ensure_ascii=False).replace('\\"', '"')

    mtime = (src / "setup.md").stat().st_mtime_ns
    sb.stage(sb.SITE_SRC, tmp_path / "stage", [])  # the lab is gone: its page and download go too
    assert not (src / "labs" / "01_fixture.ipynb").exists() and not (src / "_student").exists()
    assert (src / "setup.md").stat().st_mtime_ns == mtime, "unchanged pages are not rewritten (Sphinx reuses them)"
    assert "No labs are published yet" in (src / "labs" / "index.md").read_text()


def test_the_landing_page_lists_every_lab_of_the_course_and_links_those_published(lab_copy, tmp_path, fake_execute):
    # site/index.md once held a hand-written list of the 6 labs that existed when it was written; labs 07-10 never
    # reached the landing page. The list is now written by the build from every lab folder's lab.yaml.
    from scalelab.course.lab import find_labs
    assert sb.LABS_MARKER in (sb.SITE_SRC / "index.md").read_text(), "site/index.md keeps the line the list goes on"
    course = [load_lab(d) for d in find_labs(sb.ROOT / "labs")]
    assert len(course) >= 10
    done = sb.ensure_executed(lab_copy, tmp_path / "executed")
    fixture = load_lab(lab_copy)
    src = sb.stage(sb.SITE_SRC, tmp_path / "stage", [(fixture, done.notebook)], [fixture, *course])
    landing = (src / "index.md").read_text()
    assert sb.LABS_MARKER not in landing
    for n, lab in enumerate([fixture, *course], 1):
        head, _, rest = lab.title.partition(": ")
        assert f"{n}. **{head}**: {rest}" in landing, lab.name
    assert "([Lab 01](labs/01_fixture.ipynb))" in landing, "a published lab links to its page"
    assert landing.count("(not on this site yet)") == len(course), "an unpublished lab is named, not linked"


def test_cli_site_build_passes_its_options_to_build_site(monkeypatch, tmp_path, capsys):
    from scalelab.cli import main
    seen = {}

    def fake_build(**kwargs):
        seen.update(kwargs)
        return sb.SiteReport(tmp_path / "html", [sb.ExecutedLab("01_fixture", tmp_path / "nb", "h", True, 3.0)], 1.0)

    monkeypatch.setattr(sb, "build_site", fake_build)
    rc = main(["site", "build", "--lab", "01_fixture", "--labs-root", str(FIXTURE_LABS), "--out",
               str(tmp_path / "html"), "--force", "--json"])
    assert rc == 0
    assert seen["only"] == ["01_fixture"] and seen["force"] is True
    assert seen["labs_root"] == str(FIXTURE_LABS) and seen["out"] == str(tmp_path / "html")
    printed = json.loads(capsys.readouterr().out)
    assert printed["labs"][0]["name"] == "01_fixture" and printed["labs"][0]["reused"] is True


def test_cli_serve_refuses_a_folder_without_a_built_site(tmp_path, capsys):
    from scalelab.cli import main
    assert main(["site", "serve", "--dir", str(tmp_path)]) == 1
    assert "build the site first" in capsys.readouterr().err


@pytest.mark.slow
def test_fixture_site_builds_for_real_with_its_plot_and_without_answers(tmp_path):
    report = sb.build_site(FIXTURE_LABS, out=tmp_path / "html", executed_root=tmp_path / "executed",
                           stage_dir=tmp_path / "stage")
    html = tmp_path / "html"
    assert [lab.name for lab in report.labs] == ["01_fixture"] and not report.labs[0].reused
    page = (html / "labs" / "01_fixture.html").read_text()
    assert "# YOUR CODE HERE" in page and "last = 14.0" in page
    images = list((html / "_images").glob("*.png"))
    assert images and any(img.name in page for img in images), "the notebook's plot is an image on the page"
    for path in html.rglob("*"):
        if path.is_file() and path.suffix in (".html", ".js", ".ipynb", ".txt", ".zip", ".json"):
            data = path.read_bytes()
            assert HIDDEN.encode() not in data and SOLUTION.encode() not in data, path
    assert (html / "_static" / "mathjax" / "MathJax.js").is_file(), "math is served by the site itself"
    again = sb.build_site(FIXTURE_LABS, out=html, executed_root=tmp_path / "executed", stage_dir=tmp_path / "stage")
    assert again.labs[0].reused
