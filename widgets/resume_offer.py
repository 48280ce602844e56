"""ResumeOffer: the runs your last server's walltime interrupted, each with the checkpoint it saved, and a button
that resumes one.

    offer = ResumeOffer()          # reads ~/.scalelab/interrupted.jsonl (the server notes each run it saved there)
    offer                          # in JupyterLab: the table, a choice and a Resume button
    run = offer.resume()           # what the button calls: the newest interrupted run (or offer.resume(i)),
    run.wait()                     # continued from its emergency checkpoint in its own folder

When a server job reaches its time limit, the server passes the job's end signal on to the runs it started with
`checkpoint.on_signal`; they save an emergency checkpoint and stop (`scalelab.hub.walltime`). The data comes from
`scalelab.train.preempt.interrupted_runs`; resuming relaunches the run's own spec.json with checkpoint.resume
(`resume_spec`), so it continues from the checkpoint's step with the same settings.
"""
from __future__ import annotations

import html
import os
import time

import ipywidgets as W

from scalelab.launch import launch
from scalelab.train.preempt import Interrupted, interrupted_runs, resume_spec


def render(runs: list[Interrupted]) -> str:
    """The interrupted runs as an HTML table (pure: tested without a kernel)."""
    if not runs:
        return "<p><i>No run was interrupted by the end of a server job.</i></p>"
    head = "".join(f"<th style='text-align:left;padding-right:1em'>{h}</th>"
                   for h in ("#", "run", "reached step", "checkpoint", "job", "when"))
    rows = []
    for i, r in enumerate(runs):
        ckpt = html.escape(os.path.basename(r.checkpoint)) if r.checkpoint else "<i>none: starts again</i>"
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(r.time)) if r.time else ""
        cells = [str(i), html.escape(str(r.run_dir)), f"{r.step} of {r.total_steps}", ckpt,
                 html.escape(r.job_id), when]
        rows.append("<tr>" + "".join(f"<td style='padding-right:1em'>{c}</td>" for c in cells) + "</tr>")
    return f"<table><tr>{head}</tr>{''.join(rows)}</table>"


class ResumeOffer:
    """The runs a server job's end interrupted, and resuming one of them."""

    def __init__(self, home: str | os.PathLike | None = None):
        self.home = home
        self.runs: list[Interrupted] = []
        self.view = W.HTML()
        self.choice = W.Dropdown(description="Run")
        self.button = W.Button(description="Resume", icon="play", button_style="success")
        self.status = W.HTML()
        self.button.on_click(lambda _: self._clicked())
        self.widget = W.VBox([self.view, W.HBox([self.choice, self.button]), self.status])
        self.last_run = None
        self.refresh()

    def refresh(self) -> list[Interrupted]:
        """Read the interrupted runs again."""
        self.runs = interrupted_runs(self.home)
        self.view.value = render(self.runs)
        self.choice.options = [(f"{i}: {os.path.basename(str(r.run_dir))} (step {r.step})", i)
                               for i, r in enumerate(self.runs)]
        self.button.disabled = not self.runs
        return self.runs

    def resume(self, which: int = 0):
        """Relaunch run number `which` (0: the newest) from its checkpoint; returns its Run handle."""
        if not 0 <= which < len(self.runs):
            raise IndexError(f"ResumeOffer has {len(self.runs)} interrupted run(s); got run number {which}: pick one "
                             f"of 0..{len(self.runs) - 1} (offer.refresh() reads them again)")
        self.last_run = launch(resume_spec(self.runs[which].run_dir))
        return self.last_run

    def _clicked(self) -> None:
        run = self.resume(self.choice.value or 0)
        self.status.value = f"<p>Resumed in {html.escape(str(run.run_dir))}: status {html.escape(run.status)}</p>"
        self.refresh()

    def _ipython_display_(self):
        from IPython.display import display
        display(self.widget)
