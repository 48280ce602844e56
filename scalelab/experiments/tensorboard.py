"""A run's event scalars as TensorBoard event files: loss, learning rate, samples/s, per-phase times, memory.

    from scalelab.experiments.tensorboard import export_scalars
    export_scalars("runs/ddp-2")          # -> runs/ddp-2/tensorboard/rank-0/events.out.tfevents..., rank-1/...

The per-rank JSONL events (`scalelab.run.events`) stay the one record of a run; this only copies their numbers
into the format TensorBoard reads, one TensorBoard "run" per rank, so the ranks' curves overlay. Exporting again
replaces what an earlier export wrote (TensorBoard would otherwise show every point twice).

In JupyterLab, the TensorBoard launcher tile (scalelab.hub.tensorboard_proxy) reads ~/labs (the home when there is
none), so a run exported under ~/labs/... shows up there without further steps.
"""
from __future__ import annotations

import math
from pathlib import Path

from ..errors import ScalelabError, SetupError
from ..run.events import EventReader, events_dir

#: step-event field -> TensorBoard tag (the phases under time/, as the run summary names them)
STEP_TAGS = {"loss": "loss", "lr": "lr", "samples_per_s": "samples_per_s", "step_s": "time/step_s",
             "data_s": "time/data_s", "compute_s": "time/compute_s", "comm_s": "time/comm_s"}
#: other event types whose numeric fields are exported as <type>/<field> (memory: state bytes and peak RSS)
GROUPED_TYPES = ("memory", "checkpoint", "end")
_NOT_VALUES = {"type", "rank", "t", "step", "steps"}


def scalars_of(events: list[dict]) -> dict[int, list[tuple[str, float, int, float]]]:
    """Per rank, the (tag, value, step, wall time) points the events hold, in event order."""
    points: dict[int, list[tuple[str, float, int, float]]] = {}
    last_step: dict[int, int] = {}
    for e in events:
        rank, kind = e.get("rank"), e.get("type")
        if not isinstance(rank, int):
            continue
        step = e.get("step", e.get("steps", last_step.get(rank, 0)))
        if kind == "step":
            last_step[rank] = step
            fields = {STEP_TAGS[k]: v for k, v in e.items() if k in STEP_TAGS}
        elif kind in GROUPED_TYPES:
            fields = {f"{kind}/{k}": v for k, v in e.items() if k not in _NOT_VALUES}
        else:
            continue
        for tag, value in fields.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                points.setdefault(rank, []).append((tag, float(value), int(step), float(e.get("t", 0.0))))
    return points


def export_scalars(run_dir, logdir=None) -> Path:
    """Write the run's event scalars as TensorBoard event files, one folder per rank under `logdir` (default
    <run_dir>/tensorboard); returns `logdir`. Earlier exports there are replaced."""
    run_dir = Path(run_dir)
    if not events_dir(run_dir).is_dir() or not any(events_dir(run_dir).glob("rank-*.jsonl")):
        raise ScalelabError(f"{run_dir}: no event files in {events_dir(run_dir)}; pass the folder of a run "
                            "(its RunSpec.output_dir, or run.run_dir of the Run handle launch() returned)")
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:  # torch's writer needs the tensorboard package
        raise SetupError(f"TensorBoard is not installed ({e}); install the course's labs extra: "
                         "pip install -e '.[labs]'") from None
    reader = EventReader(run_dir)
    reader.poll()
    logdir = Path(logdir) if logdir is not None else run_dir / "tensorboard"
    for rank, points in sorted(scalars_of(reader.all).items()):
        folder = logdir / f"rank-{rank}"
        folder.mkdir(parents=True, exist_ok=True)
        for old in folder.glob("events.out.tfevents.*"):  # ours from an earlier export: replaced, not doubled
            old.unlink()
        writer = SummaryWriter(log_dir=str(folder))
        try:
            for tag, value, step, wall in points:
                writer.add_scalar(tag, value, global_step=step, walltime=wall)
        finally:
            writer.close()
    return logdir
