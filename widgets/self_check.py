"""SelfCheck: a button that runs the lab's public checks against this kernel's records and shows the results.

    from scalelab.widgets import SelfCheck
    SelfCheck()                 # in the last cell of a lab; click "Check my work"
    SelfCheck().check()         # the same without a click (button clicks never fire under papermill)

All logic is `scalelab.grade.selfcheck.self_check`; this only wires a Button and an HTML view to it.
"""
from __future__ import annotations

import html
from pathlib import Path
from typing import Any, Mapping

import ipywidgets as w

from scalelab.grade.selfcheck import SelfCheckReport, self_check
from scalelab.errors import ScalelabError


class SelfCheck(w.VBox):
    """Button + results table over `self_check(lab_dir)`; `report` holds the last SelfCheckReport."""

    def __init__(self, lab_dir: str | Path | None = None, records: Mapping[str, Any] | None = None, **kwargs):
        self.lab_dir, self.records = lab_dir, records
        self.report: SelfCheckReport | None = None
        self.button = w.Button(description="Check my work", icon="check", button_style="primary")
        self.result = w.HTML(value="<i>Run the lab's cells, then check your work (public checks only).</i>")
        self.button.on_click(lambda _: self.check())
        super().__init__([self.button, self.result], **kwargs)

    def check(self) -> SelfCheckReport | None:
        """Run the public checks now and show the results; returns the report (None if it could not run)."""
        try:
            self.report = self_check(self.lab_dir, self.records)
        except ScalelabError as e:
            self.report = None
            self.result.value = f"<p style='color:#a11'>Self-check could not run: {html.escape(str(e))}</p>"
            return None
        self.result.value = self.report.html()
        return self.report


__all__ = ["SelfCheck"]
