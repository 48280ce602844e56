"""The grader's scorer of a run's checkpoints (scalelab/train/heldout.py, run in the grading sandbox by
grade/heldout.py) on files a student's code wrote: real checkpoints are scored; a checkpoint that would run code when
unpickled, a link out of the run, an entry naming a file outside its folder, a model of another shape and a file
past the size cap are refused, each with a reason, and never stop the other checkpoints from being scored."""
from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys

import pytest
import torch

from scalelab.ckpt import save_checkpoint
from scalelab.ckpt.manifest import checksum_file
from scalelab.run.field_groups import ModelSpec
from scalelab.train import heldout
from scalelab.train.models import build_model

HELDOUT = {"source": "heat", "size": 16, "classes": 4, "samples": 256, "seed": 12345,
           "model": {"name": "cnn", "width": 16, "depth": 2}}


def _run(tmp_path, width=16):
    model = build_model(ModelSpec("cnn", width=width, depth=2), 1, 16, 4, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ck = tmp_path / "run" / "checkpoints"
    for step in (10, 20):
        save_checkpoint(ck, step, model, opt, keep_last=10)
    torch.save(model.state_dict(), ck.parent / "model.pt")
    return ck


def _enter(ck, name: str) -> None:
    """List file `name` in the manifest with its real checksum, as a forger who read ckpt/manifest.py would."""
    manifest = json.loads((ck / "manifest.json").read_text())
    manifest["checkpoints"].append({"step": 30, "file": name, "checksum": checksum_file(ck / name)
                                    if (ck / name).is_file() else "crc32:00000000", "t": 0.0})
    (ck / "manifest.json").write_text(json.dumps(manifest))


def test_real_checkpoints_and_the_final_weights_are_scored(tmp_path):
    ck = _run(tmp_path)
    x, y = heldout.heldout_set(HELDOUT)
    got = heldout.score_run(ck, HELDOUT, x, y)
    assert set(got["accuracy"]) == {"10", "20", heldout.FINAL} and "error" not in got
    assert all(0.0 <= a <= 1.0 for a in got["accuracy"].values())
    assert got["accuracy"]["10"] == got["accuracy"][heldout.FINAL]  # the same weights score the same


class _Payload:
    def __reduce__(self):
        return (os.system, (f"touch {os.environ['SCORER_MARKER']}",))


def test_a_checkpoint_that_would_run_code_is_refused_and_runs_nothing(tmp_path, monkeypatch):
    ck = _run(tmp_path)
    marker = tmp_path / "pwned"
    monkeypatch.setenv("SCORER_MARKER", str(marker))
    with open(ck / "step-00000030.pt", "wb") as f:
        pickle.dump({"step": 30, "model": _Payload()}, f)
    _enter(ck, "step-00000030.pt")
    x, y = heldout.heldout_set(HELDOUT)
    got = heldout.score_run(ck, HELDOUT, x, y)
    assert not marker.exists(), "unpickling the student's checkpoint ran its code"
    assert "30" not in got["accuracy"] and "step-00000030.pt" in got["error"]
    assert {"10", "20", heldout.FINAL} <= set(got["accuracy"])  # the others still count
    with open(ck / "step-00000030.pt", "rb") as f:
        pickle.load(f)  # what the refusal prevents: unpickled plainly, the file runs its command
    assert marker.exists()


@pytest.mark.parametrize("attack", ["link", "outside", "too_large", "other_shape"])
def test_files_a_forger_arranged_are_refused(tmp_path, attack, monkeypatch):
    ck = _run(tmp_path, width=32 if attack == "other_shape" else 16)
    x, y = heldout.heldout_set(HELDOUT)
    if attack == "link":  # a checkpoint that is a link to a file elsewhere (another student's, say)
        (ck / "step-00000030.pt").symlink_to(ck / "step-00000010.pt")
        _enter(ck, "step-00000030.pt")
    elif attack == "outside":
        (tmp_path / "elsewhere.pt").write_bytes((ck / "step-00000010.pt").read_bytes())
        _enter(ck, "../../elsewhere.pt")
    elif attack == "too_large":
        monkeypatch.setattr(heldout, "MAX_CHECKPOINT_BYTES", 1000)
    got = heldout.score_run(ck, HELDOUT, x, y)
    if attack in ("link", "outside"):
        assert "30" not in got["accuracy"] and "not a checkpoint of the run" in got["error"]
    else:  # every checkpoint refused: nothing scored
        assert [s for s in got["accuracy"] if s.isdigit()] == [] and got["error"]
        assert ("larger than" if attack == "too_large" else "size mismatch") in got["error"]


def test_the_scorer_runs_as_a_command_with_a_request_and_an_answer(tmp_path):
    ck = _run(tmp_path)
    request = tmp_path / "request.json"
    request.write_text(json.dumps({"heldout": HELDOUT, "runs": [{"key": "run", "checkpoints": str(ck)},
                                                                {"key": "gone", "checkpoints": str(tmp_path / "no")}]}))
    subprocess.run([sys.executable, "-P", "-m", "scalelab.train.heldout", str(request), str(tmp_path / "a.json")],
                   check=True, cwd=tmp_path, timeout=120)
    answer = json.loads((tmp_path / "a.json").read_text())["runs"]
    assert set(answer["run"]["accuracy"]) == {"10", "20", "final"}
    assert answer["gone"] == {"error": "the run kept no checkpoint folder"}
