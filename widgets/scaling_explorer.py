"""ScalingExplorer: a sweep over worker counts or batch sizes -> speedup, efficiency, time breakdown, table.

    ex = ScalingExplorer(preset="tiny", out_dir="runs")
    ex                               # the form, Run/Stop buttons, progress, table and plots
    ex.mode.value = "strong"
    rows = ex.run()                  # what the Run button calls (in a thread); a cell calls it directly

The logic is `scalelab.experiments.sweep` (specs, sequential runs, table); this class wires it to widgets. Runs measured by an
earlier sweep of the same explorer are reused (the 1-worker run of a weak and a strong sweep, for instance).
"""
from __future__ import annotations

import html
import threading
from pathlib import Path

import ipywidgets as W

from scalelab.errors import SpecError
from scalelab.run.validate import LAUNCHERS, STRATEGIES
from scalelab.run.spec import PRESETS, preset as make_preset
from scalelab.experiments.sweep import MODES, SweepStopped, format_table, run_sweep, scaling_table, sweep_specs

from ._plots import png_bytes, scaling_figure


def _ints(text: str, field: str) -> list[int]:
    try:
        values = [int(x) for x in str(text).replace(",", " ").split()]
    except ValueError:
        raise SpecError(field, f"got {text!r}; expected whole numbers separated by commas, e.g. 1, 2, 4") from None
    if not values or any(v < 1 for v in values):
        raise SpecError(field, f"got {text!r}; expected at least one number, all >= 1")
    return values


class ScalingExplorer:
    """A form over a scaling sweep and the table and plots of its results."""

    def __init__(self, preset: str = "tiny", out_dir: str = "runs", overrides: dict | None = None,
                 name: str = "scaling", **values):
        self.out_dir, self.overrides, self.name = Path(out_dir), dict(overrides or {}), name
        self.preset = W.Dropdown(options=list(PRESETS), value=preset, description="preset")
        self.mode = W.Dropdown(options=list(MODES), value="weak", description="mode")
        self.workers = W.Text(value="1, 2", description="workers")
        self.batches = W.Text(value="16, 32, 64", description="batch/worker")
        self.global_batch = W.BoundedIntText(value=0, min=0, max=10_000_000, description="global batch")
        self.steps = W.BoundedIntText(value=make_preset(preset).steps, min=1, max=10_000_000, description="steps")
        self.strategy = W.Dropdown(options=list(STRATEGIES), value=make_preset(preset).strategy, description="strategy")
        self.launcher = W.Dropdown(options=list(LAUNCHERS), value=make_preset(preset).launcher, description="launcher")
        self.message = W.HTML()
        self.progress = W.HTML("idle")
        self.table = W.HTML()
        self.plot = W.Image(format="png", layout=W.Layout(display="none"))  # shown once a sweep has a figure
        self.run_button = W.Button(description="Run sweep", button_style="success", icon="play")
        self.stop_button = W.Button(description="Stop", button_style="danger", icon="stop", disabled=True)
        self.run_button.on_click(lambda _: self.start())
        self.stop_button.on_click(lambda _: self.stop())
        for field, value in values.items():
            getattr(self, field).value = value
        self.rows: list[dict] = []
        self.specs_run: list = []
        self.cache: dict = {}
        self.history: list[dict] = []
        self._stopping = False
        self._thread: threading.Thread | None = None
        for w in (self.preset, self.mode, self.workers, self.batches, self.global_batch, self.steps, self.strategy,
                  self.launcher):
            w.observe(lambda _: self.validate(), names="value")
        self.validate()

    # -- the form ---------------------------------------------------------------------------------------
    def specs(self) -> list:
        """The sweep's RunSpecs, from the form; raises SpecError naming the bad field."""
        base = make_preset(self.preset.value).with_overrides(
            {**self.overrides, "steps": self.steps.value, "strategy": self.strategy.value,
             "launcher": self.launcher.value})
        return sweep_specs(base, self.mode.value, workers=_ints(self.workers.value, "workers"),
                           batches=_ints(self.batches.value, "batches"), global_batch=self.global_batch.value or None,
                           name=self.name, out_dir=self.out_dir)

    def validate(self) -> str | None:
        """Show and return the form's problem (None when every run of the sweep is a valid RunSpec)."""
        try:
            specs = self.specs()
        except SpecError as e:
            self.message.value = f"<span style='color:#b00'>&#9888; {html.escape(str(e))}</span>"
            self.run_button.disabled = True
            return str(e)
        points = ", ".join(f"{s.world_size}x{s.optim.batch_per_worker}" for s in specs)
        mode = self.mode.value
        # Only the fields this mode uses are open: the form never shows a value the sweep does not run with.
        self.workers.disabled = mode == "batch"
        self.batches.disabled = mode != "batch"
        self.global_batch.disabled = mode != "strong"
        self.message.value = f"<span style='color:#070'>ok: {len(specs)} runs (workers x batch): {points}</span>"
        self.run_button.disabled = self.running
        return None

    # -- running ----------------------------------------------------------------------------------------
    @property
    def running(self) -> bool:
        """True while a sweep started by the Run button is going on."""
        return self._thread is not None and self._thread.is_alive()

    def run(self, timeout: float = 600) -> list[dict]:
        """Run the sweep now (blocking) and return its rows; updates the table, plots and history."""
        specs = self.specs()
        self._stopping = False
        self.stop_button.disabled, self.run_button.disabled = False, True
        self.progress.value = f"running 1/{len(specs)} ..."

        def progress(i, spec, summary):
            self.progress.value = (f"{i + 1}/{len(specs)} done: {spec.world_size} workers x "
                                   f"{spec.optim.batch_per_worker} -> {summary['samples_per_s']:.0f} samples/s")
            if self._stopping:
                raise SweepStopped(f"stopped after {i + 1} of {len(specs)} runs")

        try:
            summaries = run_sweep(specs, timeout=timeout, on_result=progress, cache=self.cache)
        finally:
            self.stop_button.disabled = True
            self.validate()
        self.specs_run = specs
        self.rows = scaling_table(specs, summaries, self.mode.value)
        self.history.append({"mode": self.mode.value, "rows": self.rows})
        self.table.value = self.table_html()
        self.plot.value = png_bytes(self.figure())
        self.plot.layout.display = None
        self.progress.value = f"done: {len(specs)} runs"
        return self.rows

    def start(self) -> threading.Thread:
        """Run the sweep in a background thread (what the Run button does: the kernel stays free)."""
        def work():
            try:
                self.run()
            except BaseException as e:  # noqa: BLE001 - a thread has nowhere to raise to: show it
                self.progress.value = f"<span style='color:#b00'>{html.escape(type(e).__name__ + ': ' + str(e))}</span>"
        self._thread = threading.Thread(target=work, name="ScalingExplorer", daemon=True)
        self._thread.start()
        return self._thread

    def stop(self) -> None:
        """Stop after the run in progress (what the Stop button does)."""
        self._stopping = True
        self.progress.value += " (stopping after this run)"

    # -- output -----------------------------------------------------------------------------------------
    def figure(self):
        """Speedup vs ideal, efficiency and time breakdown of the last sweep."""
        x_key = "batch_per_worker" if self.mode.value == "batch" else "workers"
        return scaling_figure(self.rows, x_key=x_key, title=f"{self.mode.value} scaling")

    def save_figure(self, path: str | Path) -> str:
        """Write the last sweep's figure as PNG; returns the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(png_bytes(self.figure()))
        return str(path)

    def show(self, path: str | Path) -> str:
        """Save the figure and display it and the text table in the notebook's output (for unattended runs)."""
        from IPython.display import Image, display
        saved = self.save_figure(path)
        print(format_table(self.rows))
        display(Image(filename=saved))
        return saved

    def table_html(self) -> str:
        """The last sweep's table as HTML (with the note the figure carries when an efficiency is above 1)."""
        from ._plots import efficiency_note
        note = efficiency_note(self.rows)
        return "<pre>" + html.escape(format_table(self.rows)) + "</pre>" + (
            f"<p style='color:#a11'>{html.escape(note)}</p>" if note else "")

    @property
    def widget(self) -> W.Widget:
        """The explorer's layout."""
        form = W.VBox([self.preset, self.mode, self.workers, self.batches])
        form2 = W.VBox([self.global_batch, self.steps, self.strategy, self.launcher])
        return W.VBox([W.HBox([form, form2]), self.message, W.HBox([self.run_button, self.stop_button]),
                       self.progress, self.table, self.plot])

    def _ipython_display_(self):
        from IPython.display import display
        display(self.widget)
