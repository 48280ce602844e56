"""Small helpers shared by the engine tests."""
from __future__ import annotations

import psutil
import torch

from scalelab.run.spec import preset


def tiny(tmp_path, name="run", workers=2, **changes):
    """The tiny preset with `workers` ranks, writing into tmp_path/name, with dotted overrides."""
    spec = preset("tiny").replace(output_dir=str(tmp_path / name))
    return spec.with_overrides({"world.workers_per_node": workers, **changes})


def processes_of(run_dir) -> list[psutil.Process]:
    """Live processes whose command line mentions the run directory (ranks, launchers, srun)."""
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            if p.info["status"] != psutil.STATUS_ZOMBIE and str(run_dir) in " ".join(p.info["cmdline"] or []):
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def final_params(run_dir) -> dict[str, torch.Tensor]:
    """The model rank 0 saved at the end of the run."""
    return torch.load(f"{run_dir}/model.pt")


def loss_curve(summary) -> list[float]:
    """Rank 0's loss per step."""
    return summary["loss_curve"]


def wait_until(predicate, timeout: float, what: str):
    """predicate()'s first truthy value, polled every 0.25 s; the test fails, naming `what`, after `timeout` s."""
    import time
    import pytest
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.25)
    pytest.fail(f"not within {timeout:g} s: {what}")


def remove_accounts(cluster, names, timeout: float = 20) -> None:
    """Tear down throwaway Unix accounts a cluster test made: their jobs cancelled first (a job of a deleted uid is
    requeued for ever), their processes killed, then the account and its association removed. Each step goes on
    past what is already gone, so a half-made account is removed too; an account or association still there after
    `timeout` s fails the test, naming it (userdel refuses while a process of the uid is alive, and a killed one
    takes a moment to be reaped; slurmdbd keeps the association while a cancelled job is still completing)."""
    import pwd
    import subprocess
    import time
    for name in names:
        cluster.run("scancel", "-u", name, check=False)
        try:
            uid = pwd.getpwnam(name).pw_uid
        except KeyError:
            uid = None  # never made, or removed already: no process can be its
        deadline = time.monotonic() + timeout
        while True:
            if uid is not None:
                _kill_uid(uid)
            r = subprocess.run(["userdel", name], capture_output=True, text=True)
            if r.returncode in (0, 6) or time.monotonic() > deadline:  # 6: no such user
                break
            time.sleep(0.25)
        assert r.returncode in (0, 6), f"account {name} left behind: `userdel {name}` says {r.stderr.strip()!r}"
        if getattr(cluster, "accounting", False):
            _remove_association(cluster, name, time.monotonic() + timeout)


def _remove_association(cluster, name: str, deadline: float) -> None:
    """sacctmgr delete user, again until it takes: slurmdbd refuses while a job of the user is still active (a
    cancelled job completing), which left associations of deleted accounts behind."""
    import time
    while True:
        said = cluster.run("sacctmgr", "-i", "delete", "user", name, check=False)
        left = cluster.run("sacctmgr", "-n", "-P", "show", "assoc", "where", f"user={name}", "format=user",
                           check=False).stdout.split()
        if name not in left:
            return
        if time.monotonic() > deadline:
            break
        time.sleep(0.5)
    said = (said.stdout + said.stderr).strip()[-300:]
    raise AssertionError(f"the association of {name} is left behind: `sacctmgr -i delete user {name}` says {said!r}")


def _kill_uid(uid: int) -> None:
    """SIGKILL every process whose real uid is `uid`."""
    for p in psutil.process_iter(["uids"]):
        try:
            if p.info["uids"] and p.info["uids"].real == uid:
                p.kill()
        except psutil.NoSuchProcess:
            pass
