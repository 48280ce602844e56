"""Lab 06 public checks: what a student can self-check on the numbers the notebook recorded."""
from scalelab.ckpt.retention import select
from scalelab.grade.checks import check


@check(points=1, needs_run=True)
def partial_and_corrupted_checkpoints_are_refused(r):
    """A stray temp file is never the latest; loading it or a corrupted copy fails with the file named."""
    a = r["anatomy"]
    assert any(name.endswith(".tmp") for name in a["files"]), "the anatomy demo left no partial file"
    assert not a["latest"].endswith(".tmp"), "a partial file was taken for the latest checkpoint"
    assert a["partial_error"] and "may be partial" in a["partial_error"], "the partial file was not refused"
    name = a["corrupt_file"].rsplit("/", 1)[-1]
    assert a["corrupt_error"] and "corrupted" in a["corrupt_error"] and name in a["corrupt_error"], \
        "the corrupted checkpoint was not refused with its name"


@check(points=2, needs_run=True)
def checksum_verified_by_hand(r):
    """Exercise 1: my_checksum equals the manifest's checksum of the latest checkpoint."""
    want = r["manifest_entry"]["checksum"]
    assert r["my_checksum"] == want, f"my_checksum {r['my_checksum']!r}, manifest {want!r}"


@check(points=2, needs_run=True)
def own_save_survives_a_kill(r):
    """Exercise 2: the kill in the middle of your save left no partial file under a checkpoint's name, the manifest
    lists every finished save with a matching checksum, and each save went temp file, fsync, rename, folder fsync."""
    k = r["kill_test"]
    assert k["save_ok"], "; ".join(k["save_problems"])


@check(points=2, needs_run=True)
def own_restore_resumes_exactly(r):
    """Exercise 3: in the planted folder your restore skipped the corrupted and the half-written checkpoints, loaded
    the newest intact one, and the run it resumed computed the uninterrupted run's losses and final state bit for bit
    (the resume after the kill, which needs your save too, is a hidden check)."""
    k = r["kill_test"]
    assert k["restore_ok"], "; ".join(k["restore_problems"])


@check(points=1, needs_run=True)
def modes_compared(r):
    """Every mode saved checkpoints; async blocked training less than sync."""
    modes = r["modes"]
    assert set(modes) >= {"sync", "async", "sharded"}, f"modes measured: {sorted(modes)}"
    for name, s in modes.items():
        assert s["checkpoints"] >= 1, f"{name} made no checkpoint"
    assert modes["async"]["blocked_s"] < modes["sync"]["blocked_s"], "async blocked longer than sync"


@check(points=2, needs_run=True)
def stall_ratio_computed(r):
    """Exercise 4: stall_ratio is async over sync blocking, below 1; least_blocking names a measured mode."""
    ratio = r["stall_ratio"]
    assert isinstance(ratio, float) and 0 < ratio < 1, f"stall_ratio should be in (0, 1), got {ratio!r}"
    assert r["least_blocking"] in r["modes"], f"least_blocking {r['least_blocking']!r} is not a measured mode"


@check(points=3, needs_run=True)
def resume_is_exact(r):
    """Exercise 5: the resumed run ends with exactly the parameters and losses of the uninterrupted one."""
    assert r["resume"]["start_step"] > 0, "the second launch did not resume from a checkpoint"
    assert r["max_param_diff"] == 0.0, f"final parameters differ by up to {r['max_param_diff']}"
    assert r["losses_equal"] is True, "the resumed losses differ from the uninterrupted run's"


@check(points=2, needs_run=True)
def retention_rule_applied(r):
    """Exercise 6: my_kept are the newest two plus the two lowest-loss checkpoints of the history."""
    kept, _ = select(r["retention_history"], keep_last=2, keep_best=2)
    want = sorted(e["step"] for e in kept)
    assert r["my_kept"] == want, f"my_kept {r['my_kept']} (expected {len(want)} steps)"


@check(points=1, needs_run=True)
def chain_of_attempts_finishes_identically(r):
    """The time-sliced run needed several attempts, the last one finished, and it matches the uninterrupted run."""
    attempts = r["slices"]["attempts"]
    assert len(attempts) >= 2, "one attempt was enough: lower time_slice_s or raise slice_steps"
    assert attempts[-1]["status"] == "succeeded", "the last attempt did not finish"
    assert r["slices"]["identical"] is True, "the chained run ended with different parameters"
