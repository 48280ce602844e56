"""Self-check: a lab's *public* checks against what the student's kernel has recorded so far.

    from scalelab.grade.selfcheck import self_check
    self_check()            # in a lab notebook: shows a table (HTML in Jupyter, text elsewhere)

The widget `scalelab.widgets.SelfCheck` is a button over this function. It runs in the student's own kernel, so
it only ever loads `checks.py` (never hidden checks, even where an instructor's copy has them), and it adds the
same evidence from event files under the lab folder that the grader adds. The grade itself comes from the
grader, which re-runs the notebook and the hidden checks elsewhere.
"""
from __future__ import annotations

import html
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from ..record import recorded
from .checks import CheckResult, lab_checks, run_checks
from .evidence import run_evidence, strip_grader_records
from ..course.lab import CHECKS, GradingError


@dataclass
class SelfCheckReport:
    """The public checks' results for the current records."""

    lab_dir: Path
    results: list[CheckResult]

    @property
    def score(self) -> float:
        """Points earned."""
        return round(sum(c.points for c in self.results), 4)

    @property
    def max_score(self) -> float:
        """Points available in the public checks."""
        return round(sum(c.max_points for c in self.results), 4)

    @property
    def passed(self) -> bool:
        """Every public check passed in full."""
        return all(c.outcome == "pass" for c in self.results)

    def text(self) -> str:
        """Plain-text table."""
        lines = [f"self-check {self.lab_dir.name}: {self.score:g} / {self.max_score:g} points (public checks)"]
        for c in self.results:
            lines.append(f"  {c.outcome:<8} {c.points:g}/{c.max_points:g}  {c.name}" + (f": {c.message}" if c.message
                                                                                      else ""))
        return "\n".join(lines)

    def html(self) -> str:
        """HTML table (what the widget shows)."""
        from .report import OUTCOME_COLOUR, OUTCOME_LABEL, checks_table_html
        counts = {o: sum(c.outcome == o for c in self.results) for o in OUTCOME_LABEL}
        tally = ", ".join(f'<span style="color:{OUTCOME_COLOUR[o]};font-weight:600">{n} {OUTCOME_LABEL[o]}</span>'
                          for o, n in counts.items() if n)
        head = (f"<p><b>Self-check {html.escape(self.lab_dir.name)}:</b> {self.score:g} / {self.max_score:g} points "
                f"from the public checks ({tally}). The grade also counts hidden checks.</p>")
        return head + checks_table_html(self.results)

    def _repr_html_(self) -> str:
        return self.html()

    def __str__(self) -> str:
        return self.text()


def find_lab_dir(lab_dir: str | Path | None = None) -> Path:
    """The lab folder: `lab_dir`, else the current folder (a notebook's kernel starts in the notebook's folder)."""
    path = Path(lab_dir) if lab_dir is not None else Path.cwd()
    if not (path / CHECKS).is_file():
        raise GradingError(f"no {CHECKS} in {path.resolve()}: run the self-check from the lab's notebook, or pass "
                           "lab_dir='path/to/the/lab'")
    return path.resolve()


def self_check(lab_dir: str | Path | None = None, records: Mapping[str, Any] | None = None) -> SelfCheckReport:
    """Run the lab's public checks on `records` (default: everything `record()` stored in this kernel)."""
    lab = find_lab_dir(lab_dir)
    values, _ = strip_grader_records(dict(recorded() if records is None else records))
    values.update(run_evidence(lab))
    return SelfCheckReport(lab, run_checks(lab_checks(lab, include_hidden=False), values))


__all__ = ["SelfCheckReport", "self_check", "find_lab_dir"]
