"""The grader's own evaluation of a run's checkpoints on a held-out set the student never saw (lab 12, the capstone).

    python -m scalelab.train.heldout <request.json> <answer.json>

runs inside the grading sandbox, as the submission's throwaway user, after the notebook's processes are all gone,
in an empty folder (grade/heldout.py plans it and reads the answer). The request names the held-out set (a
seeded data set of the engine's: `heat` fields of a seed kept in the lab's hidden checks) and the model (the
challenge's fixed architecture, built here: a checkpoint of another shape does not load) and, per run, its
checkpoint folder. Every checkpoint the run's manifest lists is verified (checksums), loaded with
weights_only=True (tensors and plain values only: a file the student's code wrote cannot run code here) into a
fresh model and scored, and so are the weights the run ended with (model.pt beside checkpoints/, as "final"); the
answer is {run: {"accuracy": {step or "final": fraction correct}, "error": why not}}.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

MAX_CHECKPOINTS = 40
"""Checkpoints scored per run (the newest ones when a run kept more)."""
MAX_CHECKPOINT_BYTES = 64 * 2**20
"""Largest checkpoint file loaded (the challenge's model is a few hundred KiB)."""
MAX_HELDOUT = 8192
FINAL = "final"
"""The answer's key for the run's last weights (its model.pt), beside the checkpoints' steps."""


def heldout_set(heldout: dict):
    """(x, y) tensors of the held-out set the request describes."""
    import torch
    from ..data import synthetic
    samples = min(int(heldout["samples"]), MAX_HELDOUT)
    if heldout.get("source", "heat") != "heat":
        raise ValueError(f"held-out source {heldout.get('source')!r}: only heat is supported")
    x, y = synthetic.heat_fields(samples, int(heldout["size"]), int(heldout["classes"]), int(heldout["seed"]))
    return torch.from_numpy(x), torch.from_numpy(y)


def score_run(ckpt_dir: Path, heldout: dict, x, y) -> dict:
    """{"accuracy": {step: accuracy}} of every listed checkpoint of one run, or {"error": why}."""
    import torch
    from ..ckpt import CheckpointError, load_any, read_manifest
    from ..run.field_groups import ModelSpec
    from .models import build_model
    if ckpt_dir.is_symlink() or not ckpt_dir.is_dir():
        return {"error": "the run kept no checkpoint folder"}
    try:
        entries = read_manifest(ckpt_dir)
    except (CheckpointError, OSError, ValueError, TypeError, KeyError) as e:
        return {"error": f"its checkpoint manifest cannot be read: {str(e)[:200]}"}
    if not isinstance(entries, list) or not entries:
        return {"error": "its manifest lists no checkpoint"}
    accuracy, problems = {}, []
    for entry in entries[-MAX_CHECKPOINTS:]:
        try:
            path = ckpt_dir / str(entry["file"])
            if path.is_symlink() or not (path.is_file() or path.is_dir()) or path.parent != ckpt_dir:
                raise CheckpointError(f"{entry['file']!r} is not a checkpoint of the run")
            files = [path] if path.is_file() else [f for f in path.rglob("*") if f.is_file() and not f.is_symlink()]
            if sum(f.stat().st_size for f in files[:1000]) > MAX_CHECKPOINT_BYTES:
                raise CheckpointError(f"{path.name} is larger than {MAX_CHECKPOINT_BYTES >> 20} MiB")
            model = build_model(ModelSpec(**heldout["model"]), x.shape[1], int(heldout["size"]),
                                int(heldout["classes"]), seed=0)
            step = load_any(path, model)  # before scoring: a subscript's target is evaluated after its value
            accuracy[str(step)] = _score(model, x, y)
        except Exception as e:  # noqa: BLE001 - a checkpoint the student's code wrote: that checkpoint only
            problems.append(f"{entry.get('file') if isinstance(entry, dict) else entry!r}: "
                            f"{type(e).__name__}: {str(e)[:160]}")
    final = ckpt_dir.parent / "model.pt"  # the weights the run ended with (rank 0 writes them after the last step)
    if final.is_file() and not final.is_symlink() and final.stat().st_size <= MAX_CHECKPOINT_BYTES:
        try:
            model = build_model(ModelSpec(**heldout["model"]), x.shape[1], int(heldout["size"]),
                                int(heldout["classes"]), seed=0)
            model.load_state_dict(torch.load(final, map_location="cpu", weights_only=True))
            accuracy[FINAL] = _score(model, x, y)
        except Exception as e:  # noqa: BLE001 - a file the student's code could have replaced
            problems.append(f"model.pt: {type(e).__name__}: {str(e)[:160]}")
    out: dict = {"accuracy": accuracy}
    if problems:
        out["error"] = "; ".join(problems[:3])
    return out


def _score(model, x, y) -> float:
    import torch
    model.eval()
    with torch.no_grad():
        correct = sum(int((model(x[i:i + 512]).argmax(dim=1) == y[i:i + 512]).sum()) for i in range(0, len(y), 512))
    return correct / len(y)


def main(argv: list[str]) -> int:
    request = json.loads(Path(argv[0]).read_text())
    import torch
    from ..machine import usable_cpus
    torch.set_num_threads(max(1, min(2, usable_cpus())))
    x, y = heldout_set(request["heldout"])
    answer = {"runs": {}}
    for run in request["runs"]:
        answer["runs"][run["key"]] = score_run(Path(run["checkpoints"]), request["heldout"], x, y)
    Path(argv[1]).write_text(json.dumps(answer))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
