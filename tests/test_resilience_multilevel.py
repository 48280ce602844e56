"""Multi-level checkpoints on real runs: each save lands in the node-local tier at once and in the shared tier in
the background; a restart on the same node reads the local tier, a restart after the node (its local tier) is gone
reads the shared one — and both resumes end bit-identical to an uninterrupted run."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from scalelab.ckpt import read_manifest
from scalelab.errors import SpecError
from scalelab.launch import launch

from helpers import final_params, tiny


def _spec(tmp_path, name, steps):
    return tiny(tmp_path, name, steps=steps, **{"checkpoint.every_steps": 4, "checkpoint.mode": "multilevel",
                                                "checkpoint.local_dir": str(tmp_path / f"{name}-node-local")})


def _resumed_from(run):
    return [e for e in run.events() if e["type"] == "start" and e["rank"] == 0][-1]["resumed_from"]


@pytest.mark.parametrize("node_lost", [False, True], ids=["node-survived", "node-lost"])
def test_a_restart_reads_the_local_tier_if_the_node_survived_else_the_shared_one(tmp_path, node_lost):
    reference = launch(tiny(tmp_path, "ref", steps=20))
    first = launch(_spec(tmp_path, "ml", 10))
    first.wait(timeout=180)
    local, shared = tmp_path / "ml-node-local", tmp_path / "ml" / "checkpoints"
    assert [e["step"] for e in read_manifest(local)] == [4, 8] == [e["step"] for e in read_manifest(shared)]
    flushed = [e for e in first.events() if e["type"] == "checkpoint_done"]
    assert [(e["step"], e["tier"]) for e in flushed] == [(4, "shared"), (8, "shared")]
    if node_lost:
        shutil.rmtree(local)
    second = launch(_spec(tmp_path, "ml", 20))
    second.wait(timeout=180)
    assert _resumed_from(second) == str((shared if node_lost else local) / "step-00000008.pt")
    reference.wait(timeout=180)
    mine, theirs = final_params(second.run_dir), final_params(reference.run_dir)
    assert all(torch.equal(mine[k], theirs[k]) for k in theirs)
    assert json.loads((tmp_path / "ml" / "spec.json").read_text())["checkpoint"]["mode"] == "multilevel"


def test_local_dir_without_multilevel_is_refused(tmp_path):
    with pytest.raises(SpecError) as e:
        tiny(tmp_path, "bad", **{"checkpoint.local_dir": "/dev/shm/x"})
    assert e.value.field == "checkpoint.local_dir"


# --- the node-local tier is a place every account can write (/dev/shm): a classmate must not get a run to read a
# --- checkpoint of theirs (issue 39). The tier's base is a sticky, world-writable folder of the test's own.

NOBODY = 65534


class _Payload:
    """What a crafted checkpoint carries: an object whose unpickling runs a command (here: makes a marker file)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        import os
        return os.system, (f"touch {self.marker}",)


def _shared_base(tmp_path, monkeypatch):
    from scalelab.ckpt import multilevel
    base = tmp_path / "shm"
    base.mkdir()
    base.chmod(0o1777)  # like /dev/shm: every account writes, the sticky bit keeps each one's names its own
    monkeypatch.setattr(multilevel, "node_local_base", lambda: base, raising=False)
    return base


def _model_and_optimizer():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _plant(directory, marker, step=8):
    """A crafted checkpoint (valid manifest entry and checksum, a pickle that runs a command) made by uid 65534."""
    import os
    from scalelab.ckpt.sync import capture, write_checkpoint
    model, opt = _model_and_optimizer()
    write_checkpoint(directory, capture(step, model, opt, {"x": _Payload(marker)}))
    for root, dirs, files in os.walk(directory):
        for name in [root, *(os.path.join(root, f) for f in files)]:
            os.chown(name, NOBODY, NOBODY)


def test_a_local_tier_a_classmate_made_first_is_refused_and_never_loaded(tmp_path, monkeypatch):
    """ATTACK: the default tier's name is computable by anyone; a classmate (uid 65534) makes it first and plants a
    checkpoint whose unpickling runs their command. The victim's run refuses the folder; nothing runs."""
    import os
    from scalelab.ckpt import CheckpointError, build_checkpointer, default_local_dir
    base, marker = _shared_base(tmp_path, monkeypatch), tmp_path / "ran-as-the-victim"
    spec = tiny(tmp_path, "victim", **{"checkpoint.every_steps": 4, "checkpoint.mode": "multilevel"})
    run_dir = tmp_path / "victim"
    run_dir.mkdir()
    target = default_local_dir(run_dir)  # what the classmate computes, as the victim's run will
    assert str(target).startswith(str(base))
    top = base / target.relative_to(base).parts[0]
    _plant(target, marker)
    os.chown(top, NOBODY, NOBODY)
    model, opt = _model_and_optimizer()
    with pytest.raises(CheckpointError, match=r"scalelab-ckpt-u0 .*belongs to .*\(uid 65534\)"):
        ck = build_checkpointer(spec.checkpoint, run_dir / "checkpoints")
        ck.restore(model, opt)
    assert not marker.exists()


@pytest.mark.parametrize("how", ["symlink-top", "symlink-leaf", "open-parent"])
def test_a_local_tier_through_a_link_or_an_open_parent_is_refused(tmp_path, monkeypatch, how):
    """ATTACK: the per-account folder is a symbolic link (the classmate's, to a folder they fill), the run's own
    folder is a link, or an explicit local_dir lies under a folder others may write that is not sticky."""
    import os
    from scalelab.ckpt import CheckpointError, MultiLevelCheckpointer, default_local_dir
    base = _shared_base(tmp_path, monkeypatch)
    run_dir = tmp_path / "victim"
    run_dir.mkdir()
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    target = default_local_dir(run_dir)
    if how == "symlink-top":
        (base / target.relative_to(base).parts[0]).symlink_to(theirs)
        os.lchown(base / target.relative_to(base).parts[0], NOBODY, NOBODY)
    elif how == "symlink-leaf":
        target.parent.mkdir(mode=0o700)
        target.symlink_to(theirs)
    else:
        target = tmp_path / "course-scratch" / "node-local"
        target.parent.mkdir()
        target.parent.chmod(0o777)
    with pytest.raises(CheckpointError, match="symbolic link|belongs to|not sticky"):
        MultiLevelCheckpointer(run_dir / "checkpoints", target)
    assert list(theirs.iterdir()) == []


def test_a_checkpoint_that_unpickles_an_object_is_refused_not_run(tmp_path):
    """ATTACK (whatever folder it came from): a checkpoint holding more than tensors and plain values is refused by
    load_checkpoint (weights_only=True); the command it carries never runs."""
    from scalelab.ckpt import CheckpointError, load_checkpoint
    from scalelab.ckpt.sync import capture, write_checkpoint
    marker = tmp_path / "ran"
    model, opt = _model_and_optimizer()
    path, _ = write_checkpoint(tmp_path / "ck", capture(8, model, opt, {"x": _Payload(marker)}))
    with pytest.raises(CheckpointError, match="not loaded"):
        load_checkpoint(path, model, opt)
    assert not marker.exists()


def test_the_default_local_tier_is_private_and_saves_and_restores(tmp_path, monkeypatch):
    """CONTROL: the default tier is made 0700 by and for this account (an own folder left open is closed), and
    a checkpoint saved there restores exactly, optimizer state included."""
    import os
    import stat
    from scalelab.ckpt import MultiLevelCheckpointer, default_local_dir
    _shared_base(tmp_path, monkeypatch)
    run_dir = tmp_path / "mine"
    run_dir.mkdir()
    target = default_local_dir(run_dir)
    target.parent.mkdir(mode=0o755)
    target.parent.chmod(0o755)  # an earlier release's, or the umask's: ours, so it is closed, not refused
    model, opt = _model_and_optimizer()
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    ck = MultiLevelCheckpointer(run_dir / "checkpoints", target)
    ck.save(8, model, opt)
    ck.close()
    for d in (target, target.parent):
        st = os.lstat(d)
        assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.geteuid()
    again, again_opt = torch.nn.Linear(4, 2), None
    again_opt = torch.optim.SGD(again.parameters(), lr=0.1, momentum=0.9)
    ck2 = MultiLevelCheckpointer(run_dir / "checkpoints", target)
    assert ck2.latest() == target / "step-00000008.pt"
    assert ck2.restore(again, again_opt) == 8
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), model.state_dict().values()))
    assert torch.equal(again_opt.state_dict()["state"][0]["momentum_buffer"],
                       opt.state_dict()["state"][0]["momentum_buffer"])
    ck2.close()
