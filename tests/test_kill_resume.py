"""Lab 06's kill test (scalelab/experiments/kill_resume.py): a save of the student's own is killed in the middle by
the kernel, fresh processes resume with the student's restore. A right save and restore pass every part; a save in
place, a restore that lists the folder and a restore that forgets the RNG each fail their own part only; the
grader's re-reading of the files in a working copy reaches the same verdict."""
from __future__ import annotations

import json
import shutil
import textwrap
from pathlib import Path

import pytest

from scalelab.experiments.kill_resume import (AFTER_KILL, LOG, _order_problems, kill_and_resume, read_log,
                                              reader_beneath, verdict)

pytestmark = pytest.mark.slow

RIGHT = '''
import io, json, os, zlib
from pathlib import Path
import torch

MANIFEST = "manifest.json"


def atomic_write(path, data):
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(directory, step, model, optimizer):
    directory = Path(directory)
    buffer = io.BytesIO()
    torch.save({"step": step, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "rng": torch.get_rng_state()}, buffer)
    data = buffer.getvalue()
    name = f"step-{step:08d}.pt"
    atomic_write(directory / name, data)
    manifest = directory / MANIFEST
    entries = json.loads(manifest.read_text())["checkpoints"] if manifest.exists() else []
    entries.append({"step": step, "file": name, "checksum": f"crc32:{zlib.crc32(data):08x}", "bytes": len(data)})
    atomic_write(manifest, json.dumps({"checkpoints": entries}).encode())


def restore(directory, model, optimizer, rng=True):
    directory = Path(directory)
    manifest = directory / MANIFEST
    entries = json.loads(manifest.read_text())["checkpoints"] if manifest.exists() else []
    for entry in reversed(entries):
        path = directory / entry["file"]
        if not path.is_file():
            continue
        data = path.read_bytes()
        if f"crc32:{zlib.crc32(data):08x}" != entry["checksum"]:
            continue
        state = torch.load(io.BytesIO(data), weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        if rng:
            torch.set_rng_state(state["rng"])
        return int(state["step"])
    return 0
'''

IN_PLACE_SAVE = '''

def save(directory, step, model, optimizer):
    directory = Path(directory)
    name = f"step-{step:08d}.pt"
    torch.save({"step": step, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "rng": torch.get_rng_state()}, directory / name)
    data = (directory / name).read_bytes()
    manifest = directory / MANIFEST
    entries = json.loads(manifest.read_text())["checkpoints"] if manifest.exists() else []
    entries.append({"step": step, "file": name, "checksum": f"crc32:{zlib.crc32(data):08x}", "bytes": len(data)})
    manifest.write_text(json.dumps({"checkpoints": entries}))
'''

NEWEST_FILE_RESTORE = '''

def restore(directory, model, optimizer):
    files = sorted(Path(directory).glob("step-*.pt"))
    if not files:
        return 0
    state = torch.load(files[-1], weights_only=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"])
    return int(state["step"])
'''

NO_RNG_RESTORE = '''
_restore = restore


def restore(directory, model, optimizer):
    return _restore(directory, model, optimizer, rng=False)
'''

NOT_WRITTEN_SAVE = '''

def save(directory, step, model, optimizer):
    raise NotImplementedError("exercise")
'''


def _kill_test(tmp_path: Path, extra: str = "") -> dict:
    (tmp_path / "my_ckpt.py").write_text(textwrap.dedent(RIGHT) + extra)
    return kill_and_resume("my_ckpt", tmp_path / "kill", source_dir=tmp_path)


def test_a_right_save_and_restore_survive_the_kill_and_resume_exactly(tmp_path):
    v = _kill_test(tmp_path)
    assert v["killed_in_save"] and v["save_ok"] and v["restore_ok"] and v["resume_ok"], v
    after = tmp_path / "kill" / AFTER_KILL
    assert sorted(p.name for p in after.iterdir()) == [".step-00000012.pt.tmp", "manifest.json",
                                                      "step-00000004.pt", "step-00000008.pt"]
    # the kill cut the temporary file at the armed size, inside the save of step 12
    crash = read_log((tmp_path / "kill" / "crash" / LOG).read_text())
    armed = next(e for e in crash if e["type"] == "armed")
    assert (after / ".step-00000012.pt.tmp").stat().st_size == armed["bytes"] < armed["checkpoint_bytes"]
    assert crash[-1] == {"type": "exit", "returncode": -25, "signal": "SIGXFSZ"}
    assert v["resume"]["restored_step"] == 8 and v["planted"]["restored_step"] == 4
    assert [x["source"] for x in v["planted"]["loaded"]] == ["step-00000004.pt"]
    # the grader reads the same files in a working copy, as data that may be hostile, and reaches the same verdict
    work = tmp_path / "work"
    shutil.copytree(tmp_path / "kill", work / "runs" / "kill")
    again = verdict(reader_beneath(work, "runs/kill"))
    assert {k: again[k] for k in ("save_problems", "restore_problems", "resume_problems", "code")} == \
        {k: v[k] for k in ("save_problems", "restore_problems", "resume_problems", "code")}
    # a partial file planted under a checkpoint's name after the kill is what the save check refuses
    (work / "runs" / "kill" / AFTER_KILL / "step-00000012.pt").write_bytes(b"PK half")
    assert any("step-00000012.pt" in p for p in verdict(reader_beneath(work, "runs/kill"))["save_problems"])


def test_a_save_in_place_leaves_a_partial_file_and_loses_only_the_save(tmp_path):
    v = _kill_test(tmp_path, IN_PLACE_SAVE)
    assert not v["save_ok"] and v["restore_ok"] and v["resume_ok"], v
    assert any("step-00000012.pt" in p and "not in the manifest" in p for p in v["save_problems"])
    assert any("not renamed into place" in p for p in v["save_problems"])


def test_a_restore_that_lists_the_folder_loads_the_partial_file(tmp_path):
    v = _kill_test(tmp_path, NEWEST_FILE_RESTORE)
    assert v["save_ok"] and not v["restore_ok"], v
    assert "step-00000012.pt (partial)" in v["restore_problems"][0]


def test_a_restore_without_the_rng_state_does_not_resume_exactly(tmp_path):
    v = _kill_test(tmp_path, NO_RNG_RESTORE)
    assert v["save_ok"] and not v["restore_ok"] and not v["resume_ok"], v
    assert "is not the one the run had" in v["resume_problems"][0]


def test_an_unwritten_save_is_reported_and_the_restore_is_still_tested(tmp_path):
    v = _kill_test(tmp_path, NOT_WRITTEN_SAVE)
    assert "not written yet" in v["save_error"] and v["restore_ok"] and not v["resume_ok"], v
    assert "no resume ran: the save raised NotImplementedError" in v["resume_problems"][0]


def test_the_order_of_a_save_s_operations():
    def op(kind, **kw):
        return {"type": "op", "op": kind, **kw}
    right = [op("open", path=".a.tmp"), op("fsync", path=".a.tmp"), op("rename", src=".a.tmp", dst="step-00000004.pt"),
             op("fsync", path="."), op("open", path=".m.tmp"), op("fsync", path=".m.tmp"),
             op("rename", src=".m.tmp", dst="manifest.json"), op("fsync", path=".")]
    assert _order_problems(right, "step-00000004.pt") == []
    no_fsync = [o for o in right if o != op("fsync", path=".a.tmp")]
    assert "was not fsynced before its rename" in _order_problems(no_fsync, "step-00000004.pt")[0]
    no_dir_sync = right[:3] + right[4:]
    assert "folder was not fsynced between" in _order_problems(no_dir_sync, "step-00000004.pt")[0]
    elsewhere = [dict(o, src="../tmp/a") if o.get("dst") == "step-00000004.pt" else o for o in right]
    assert "outside the checkpoint folder" in _order_problems(elsewhere, "step-00000004.pt")[0]
    manifest_in_place = right[:4]
    assert "manifest.json was not replaced by a rename" in _order_problems(manifest_in_place, "step-00000004.pt")[0]
    assert json.dumps(right)  # the log holds plain JSON
