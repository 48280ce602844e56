"""LaunchPanel: a RunSpec form -> a Run -> live per-rank loss and samples/s, status, stop.

    panel = LaunchPanel(preset="tiny", out_dir="runs")
    panel                        # in JupyterLab: the form, Launch/Stop buttons, live plots
    panel.workers.value = 2      # what a student does with the form, a cell can do too
    panel.launch()               # what the Launch button calls (it also starts a watcher thread)
    summary = panel.follow(120)  # what a cell under papermill calls: refresh until the run ends

Every button calls a public method (`launch`, `stop`); `refresh()` polls the Run once and updates
`panel.series` (plain Python: {"loss": {rank: [(step, value)]}, "samples_per_s": {...}}). The form validates on
every change through `RunSpec.validate()`, so a student sees the SpecError that names the field.
"""
from __future__ import annotations

import threading
import time
from pathlib import Path

import ipywidgets as W

from scalelab.errors import RunFailed, RunTimeout, SpecError
from scalelab.run.validate import LAUNCHERS, PRECISIONS, STRATEGIES
from scalelab.run.spec import PRESETS, preset as make_preset

from ._plots import png_bytes, run_figure, run_series

# form field -> RunSpec dotted field
FIELDS = {"workers": "world.workers_per_node", "nodes": "world.nodes", "strategy": "strategy", "launcher": "launcher",
          "batch": "optim.batch_per_worker", "lr": "optim.lr", "steps": "steps", "precision": "precision"}
ACTIVE = ("pending", "running")


class LaunchPanel:
    """A form over a RunSpec, the Run it launched, and that Run's live per-rank plots."""

    def __init__(self, preset: str = "tiny", out_dir: str = "runs", overrides: dict | None = None,
                 name: str = "panel", **values):
        self.out_dir = Path(out_dir)
        self.overrides = dict(overrides or {})
        self.name = name
        self.run = None
        self.runs: list = []
        self.series = run_series([])
        self._seen = 0
        self.ready: set[int] = set()
        """Ranks of the current run that have started training (sent their start event)."""
        self.draws = 0
        """How many times the plot was drawn (each a new image in the browser)."""
        self._watcher: threading.Thread | None = None
        self.preset = W.Dropdown(options=list(PRESETS), value=preset, description="preset")
        self.workers = W.BoundedIntText(min=1, max=1024, description="workers/node")
        self.nodes = W.BoundedIntText(min=1, max=4096, description="nodes")
        self.strategy = W.Dropdown(options=list(STRATEGIES), description="strategy")
        self.launcher = W.Dropdown(options=list(LAUNCHERS), description="launcher")
        self.batch = W.BoundedIntText(min=1, max=1_000_000, description="batch/worker")
        self.lr = W.BoundedFloatText(min=0.0, max=100.0, step=0.01, description="lr")
        self.steps = W.BoundedIntText(min=1, max=10_000_000, description="steps")
        self.precision = W.Dropdown(options=list(PRECISIONS), description="precision")
        self.message = W.HTML()
        self.status = W.HTML("status: <b>idle</b>")
        self.launch_button = W.Button(description="Launch", button_style="success", icon="play")
        self.stop_button = W.Button(description="Stop", button_style="danger", icon="stop", disabled=True)
        self.plot = W.Image(format="png", value=png_bytes(run_figure(self.series, "launch a run: its per-rank "
                                                                          "curves appear here, step by step")))
        self.launch_button.on_click(self._on_launch_click)
        self.stop_button.on_click(lambda _: self.stop())
        self._load_preset(preset)
        for field, value in values.items():
            self.controls[field].value = value
        self.preset.observe(lambda ch: self._load_preset(ch["new"]), names="value")
        for w in self.controls.values():
            w.observe(lambda _: self.validate(), names="value")
        self.validate()

    # -- the form ---------------------------------------------------------------------------------------
    @property
    def controls(self) -> dict:
        """Form field name -> widget (the fields of FIELDS)."""
        return {f: getattr(self, f) for f in FIELDS}

    def _load_preset(self, name: str) -> None:
        base = make_preset(name)
        values = {"workers": base.world.workers_per_node, "nodes": base.world.nodes, "strategy": base.strategy, "launcher": base.launcher,
                  "batch": base.optim.batch_per_worker, "lr": base.optim.lr, "steps": base.steps,
                  "precision": base.precision}
        for field, value in values.items():  # an override of a form field beats the preset (no check yet)
            self.controls[field].value = self.overrides.get(FIELDS[field], value)

    def spec(self):
        """The RunSpec the form describes (preset, the panel's overrides, then the form); raises SpecError."""
        base = make_preset(self.preset.value)
        changes = {**self.overrides, **{FIELDS[f]: w.value for f, w in self.controls.items()}}
        changes.setdefault("name", self.name)
        return base.with_overrides(changes)

    def validate(self) -> str | None:
        """Check the form; show and return the SpecError message (None when the spec is valid)."""
        try:
            spec = self.spec()
        except SpecError as e:
            self.message.value = f"<span style='color:#b00'>&#9888; {_escape(str(e))}</span>"
            self.launch_button.disabled = True
            return str(e)
        self.message.value = (f"<span style='color:#070'>ok: {spec.world_size} ranks, global batch "
                              f"{spec.global_batch}</span>")
        self.launch_button.disabled = self.active
        return None

    # -- the run ----------------------------------------------------------------------------------------
    @property
    def active(self) -> bool:
        """True while the panel's run is pending or running."""
        return self.run is not None and self.run.status in ACTIVE

    def launch(self):
        """Launch the form's spec (what the Launch button does, minus the watcher thread); returns the Run."""
        from scalelab.launch import launch
        if self.active:
            raise RuntimeError("a run from this panel is still going; stop it or wait for it first")
        spec = self.spec()
        out = self.out_dir / f"{spec.name}-{len(self.runs) + 1}-{spec.world_size}w-{time.strftime('%H%M%S')}"
        self.run = launch(spec.replace(output_dir=str(out)))
        self.runs.append(self.run)
        self.series, self._seen, self.ready = run_series([]), 0, set()
        self.stop_button.disabled, self.launch_button.disabled = False, True
        self._show_status()
        return self.run

    def refresh(self, draw: bool = True) -> dict:
        """Poll the run once: new events into `series`, status text, and (draw=True) the plot. Returns series."""
        if self.run is None:
            return self.series
        new = self.run.events(since=self._seen)
        self._seen += len(new)
        self.ready.update(e.get("rank") for e in new if e.get("type") == "start")
        run_series(new, since=self.series)
        self._show_status()
        if draw:
            self.plot.value = png_bytes(self.figure())
            self.draws += 1
        if not self.active:
            self.stop_button.disabled = True
            self.validate()
        return self.series

    def follow(self, timeout: float | None = None, every: float = 1.0, show: bool = True,
               draw_every: float | None = 1.0) -> dict:
        """Refresh until the run ends (what a notebook cell calls), redrawing the panel's plot every `draw_every`
        seconds (None: only at the end) so the panel shown above follows the run live; saves and shows the
        final figure.

        Returns the run's summary; raises RunFailed like `Run.wait` when the run failed, RunTimeout (after
        stopping the run) when `timeout` passes first.
        """
        if self.run is None:
            raise RuntimeError("nothing to follow: call launch() first")
        deadline = None if timeout is None else time.monotonic() + timeout
        last_draw = time.monotonic()
        while self.active:
            if deadline is not None and time.monotonic() > deadline:
                self.stop()
                raise RunTimeout(f"run {self.run.run_dir.name} did not finish within {timeout:g} s; it was stopped")
            draw = draw_every is not None and time.monotonic() - last_draw >= draw_every
            self.refresh(draw=draw)
            if draw:
                last_draw = time.monotonic()
            time.sleep(every)
        self.refresh(draw=True)
        path = self.save_figure()
        if show:
            _display_png(path)
        if self.run.status == "failed":
            raise RunFailed(self.run.error, rank=self.run.failed_rank, run_dir=str(self.run.run_dir))
        return self.run.summary()

    def stop(self) -> None:
        """Stop the run (what the Stop button does); the plot's title and the status then say so."""
        if self.run is not None:
            self.run.stop()
            self.refresh(draw=True)

    def figure(self):
        """The current per-rank loss and samples/s figure."""
        title = f"{self.run.run_dir.name}: {self.run.status}" if self.run else ""
        return run_figure(self.series, title)

    def save_figure(self, path: str | Path | None = None) -> str:
        """Write the current figure as PNG (default: panel.png in the run directory); returns the path."""
        path = Path(path) if path else self.run.run_dir / "panel.png"
        path.write_bytes(png_bytes(self.figure()))
        return str(path)

    def plot_data(self) -> dict:
        """The plotted series as plain Python: {"loss": {rank: [(step, value)]}, "samples_per_s": ...}."""
        return {m: {r: list(pts) for r, pts in per_rank.items()} for m, per_rank in self.series.items()}

    # -- interactive use (buttons) ----------------------------------------------------------------------
    def _on_launch_click(self, _button=None) -> None:
        try:
            self.launch()
        except Exception as e:  # noqa: BLE001 - a button has nowhere to raise to: show it in the form
            self.message.value = f"<span style='color:#b00'>&#9888; {_escape(str(e))}</span>"
            return
        self.start_watching()

    def start_watching(self, every: float = 1.0) -> threading.Thread:
        """Refresh in a background thread until the run ends (live plots while the kernel stays free)."""
        def loop():
            while self.active:
                self.refresh(draw=True)
                time.sleep(every)
            self.refresh(draw=True)
        self._watcher = threading.Thread(target=loop, name="LaunchPanel-watcher", daemon=True)
        self._watcher.start()
        return self._watcher

    def _show_status(self) -> None:
        run = self.run
        if run is None:
            return
        steps = max((pts[-1][0] for pts in self.series["loss"].values() if pts), default=0)
        rates = [pts[-1][1] for pts in self.series["samples_per_s"].values() if pts]
        text = f"status: <b>{run.status}</b> &middot; step {steps}/{run.spec.steps}"
        if run.status in ACTIVE and not steps:  # workers start (seconds, with a cold import of torch)
            text = (f"status: <b>starting</b> &middot; {len(self.ready)} of {run.spec.world_size} ranks ready "
                    "(each rank starts Python and torch, then joins the process group)")
        if rates:
            text += f" &middot; {sum(rates):.0f} samples/s over {len(rates)} ranks"
        if run.status == "failed":
            text += f"<br><span style='color:#b00'>{_escape(run.error or '')}</span>"
        self.status.value = text

    @property
    def widget(self) -> W.Widget:
        """The panel's layout (form, buttons, status, plot)."""
        form = W.VBox([self.preset, self.workers, self.nodes, self.strategy, self.launcher])
        form2 = W.VBox([self.batch, self.lr, self.steps, self.precision])
        buttons = W.HBox([self.launch_button, self.stop_button])
        return W.VBox([W.HBox([form, form2]), self.message, buttons, self.status, self.plot])

    def _ipython_display_(self):
        from IPython.display import display
        display(self.widget)


def _escape(text: str) -> str:
    import html
    return html.escape(text).replace("\n", "<br>")


def _display_png(path: str) -> None:
    from IPython.display import Image, display
    display(Image(filename=path))
