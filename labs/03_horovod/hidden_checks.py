"""Lab 03 hidden checks: the engine runs against their event files; the port, its averaged metric and the fusion
sweep against the files their ranks wrote; the comparison and timeline cross-checked.

The DDP and Horovod engine runs write events, and the profiled Horovod run its timeline, which the grader re-reads
from the working copy (no link followed) to re-derive the fusion counts. The port's ranks write their own result
files into the pool's folder (`result-0-<rank>.json`: what each rank returned, digests of its parameters and
optimizer state included); the checks read those, not the record, to verify the port's effect and the averaged
metric. Each fusion sweep point is a Horovod job with its own timeline, which the grader re-reads to re-derive the
student's readings and choice, and to see each point's setting at work (no fusion at threshold 0, cycles no
shorter than the cycle time). Every check needs a real run (`needs_run`).
"""
import json
import math
import statistics
from collections import defaultdict

from scalelab.experiments.horovod_port import fusion_summary, horovod_timeline_text
from scalelab.experiments.profiling import read_run_file
from scalelab.grade.checks import check, close, evidence, param
from scalelab.grade.evidence import RUNS, WORKDIR

CONTROLLERS = {"horovodrun": "gloo", "mpirun": "mpi"}


@check(points=0.5, needs_run=True)
def engine_runs_are_the_engine_runs(r):
    """Each engine run's strategy, world size, samples/s (global and per rank), final loss and loss curve are what
    its event files show."""
    for x in r["engine_runs"]:
        found = evidence(r, x["run_dir"], total_steps="steps", world_size="workers")
        what = f"{x['strategy']} run"
        assert found["strategy"] == x["strategy"], f"{what}: the events are of a {found['strategy']} run"
        assert found["world_size"] == len(x["per_rank_samples_per_s"]) >= 2, f"{what}: {found['world_size']} ranks"
        close(found["samples_per_s"], x["samples_per_s"], what=f"{what} samples/s")
        for a, b in zip(found["per_rank_samples_per_s"], x["per_rank_samples_per_s"]):
            close(a, b, what=f"{what} per-rank samples/s")
        close(found["final_loss"], x["final_loss"], what=f"{what} final loss")
        assert found["loss_curve"] == x["loss_curve"], f"{what}: the loss curve is not the run's"


@check(points=3, needs_run=True)
def comparison_recomputed(r):
    """The comparison follows from the recorded engine runs."""
    ddp, hvd = r["engine_runs"]
    c = r["comparison"]
    diff = max(abs(a - b) for a, b in zip(ddp["loss_curve"], hvd["loss_curve"]))
    assert math.isclose(c["max_loss_diff"], diff, rel_tol=1e-6, abs_tol=1e-12)
    rate = {x["strategy"]: evidence(r, x["run_dir"])["samples_per_s"] for x in (ddp, hvd)}
    close(rate["horovod"] / rate["ddp"], c["hvd_over_ddp"], what="hvd_over_ddp")


@check(points=0.5, needs_run=True)
def throughput_is_the_sum_of_ranks(r):
    """Each run's samples/s is the sum of its ranks'."""
    for x in r["engine_runs"]:
        assert math.isclose(x["samples_per_s"], sum(x["per_rank_samples_per_s"]), rel_tol=1e-6)


@check(points=0.5, needs_run=True)
def ranks_trained_on_their_own_shards(r):
    """In the port, ranks saw different data (different losses), the same under both controllers."""
    assert {"horovodrun", "mpirun"} <= set(r["port"]), f"the port ran under {sorted(r['port'])} only"
    gloo, mpi = r["port"]["horovodrun"]["ranks"], r["port"]["mpirun"]["ranks"]
    assert gloo[0]["losses"] != gloo[1]["losses"]
    assert [x["losses"] for x in gloo] == [x["losses"] for x in mpi], "same port, same data: same losses"


@check(points=2, needs_run=True)
def timeline_names_the_model_tensors(r):
    """The timeline's tensors are the model's gradients (allreduce.<parameter name>)."""
    names = r["timeline"]["tensors"]
    assert any(n.startswith("allreduce.") and n.endswith(".weight") for n in names), names[:5]


@check(points=0.5, needs_run=True)
def horovod_fusion_is_the_timeline(r):
    """The fusion counts are what the Horovod engine run's own timeline shows."""
    f = r["hvd_fusion"]
    found, work = evidence(r, f["run_dir"]), r[WORKDIR]
    assert found["strategy"] == "horovod", f"the events are of a {found['strategy']} run"
    try:
        text = read_run_file(work, f"{f['run_dir']}/traces/horovod-timeline.json")
        again = fusion_summary(horovod_timeline_text(text))
    except Exception as e:  # missing, a link, too big, not a timeline: all the student's files
        raise AssertionError(f"the run's Horovod timeline could not be read ({type(e).__name__}: {e})") from None
    for key in ("tensors", "allreduces", "fused_allreduces", "cycles"):
        assert again[key] == f[key], f"{key}: the timeline shows {again[key]}, the record says {f[key]}"
    close(again["negotiate_ms"], f["negotiate_ms"], what="mean negotiation ms")


def _workdir(r) -> str:
    """The working copy the grader re-reads files from (absent outside the grader: the check ends as missing)."""
    r[RUNS]  # noqa: B018 - asked first, so a check without the grader's view names the same record as the others
    return r[WORKDIR]


def _read_json(work, path):
    try:
        return json.loads(read_run_file(work, path, max_bytes=2**20))
    except Exception as e:  # missing, a link, too big, not JSON: all the student's files
        raise AssertionError(f"{path} could not be read ({type(e).__name__}: {e})") from None


def _port_files(r) -> dict:
    """{launcher: the rows the port's ranks wrote into their pool's folder}, each checked equal to the record."""
    work, found = _workdir(r), {}
    assert r["port"] and set(r["port"]) <= set(CONTROLLERS), f"the port ran under {sorted(r['port'])}"
    for launcher, x in r["port"].items():
        rows = [_read_json(work, f"{x['run_dir']}/result-0-{rank}.json") for rank in range(len(x["ranks"]))]
        assert rows == x["ranks"], f"{launcher}: the recorded port is not what its ranks wrote"
        assert len(rows) == rows[0]["size"] >= 2, f"{launcher}: {len(rows)} ranks"
        assert {row["controller"] for row in rows} == {CONTROLLERS[launcher]}, f"{launcher}: not its controller"
        found[launcher] = rows
    return found


@check(points=6, needs_run=True)
def port_state_is_rank_zeros_on_every_rank(r):
    """Exercise 1, from the ranks' own files: the ranks started with different optimizer state, and after the port
    every rank holds rank 0's optimizer state and parameters bit for bit, equal to the one-process reference."""
    for launcher, rows in _port_files(r).items():
        assert not [m for row in rows for m in row["not_implemented"] if m.endswith(":make_distributed")], \
            f"{launcher}: make_distributed is not implemented yet"
        assert all(row["state_spread_before"] > 0 for row in rows[1:]), f"{launcher}: the ranks started equal"
        assert len({row["state_sha256"] for row in rows}) == 1, \
            f"{launcher}: the ranks' optimizer states differ after the port (broadcast_optimizer_state?)"
        assert len({row["params_sha256"] for row in rows}) == 1, f"{launcher}: the replicas are not bit-identical"
        assert max(row["reference_max_diff"] for row in rows) < 1e-5, f"{launcher}: not the reference's training"


@check(points=6, needs_run=True)
def averaged_metric_is_the_ranks_mean(r):
    """Exercise 2, from the ranks' own files: each step's averaged loss is the same on every rank and is the mean of
    the ranks' own losses."""
    for launcher, rows in _port_files(r).items():
        averaged = [row["averaged_losses"] for row in rows]
        assert all(isinstance(a, list) and len(a) == len(rows[0]["losses"]) for a in averaged), \
            f"{launcher}: no averaged losses (average_metric not implemented?)"
        for step in range(len(rows[0]["losses"])):
            mean = sum(row["losses"][step] for row in rows) / len(rows)
            for row, a in zip(rows, averaged):
                assert math.isclose(a[step], mean, rel_tol=1e-5), \
                    f"{launcher} step {step}: rank {row['rank']} averaged {a[step]:.6g}, the ranks' mean is {mean:.6g}"


def sweep_reading(timeline: dict) -> dict:
    """The grader's reading of one sweep point's timeline (what exercise 4 asks for)."""
    reduces, negotiations = defaultdict(list), defaultdict(list)
    for activity, start, end, tensor in sorted(timeline["spans"], key=lambda s: s[1]):
        if tensor.startswith("allreduce.") and activity in ("ALLREDUCE", "NEGOTIATE_ALLREDUCE"):
            (reduces if activity == "ALLREDUCE" else negotiations)[tensor].append((start, end))
    steps = min((len(v) for v in reduces.values()), default=0)
    fused, firsts = 0, []
    for k in range(steps):
        groups = []
        for start, end in sorted(v[k] for v in reduces.values()):
            if groups and start < groups[-1][1]:
                groups[-1][1] = max(groups[-1][1], end)
            else:
                groups.append([start, end])
        fused += len(groups)
        firsts.append(min(v[k][0] for v in negotiations.values() if len(v) > k))
    gaps = [b - a for a, b in zip(firsts, firsts[1:])]
    return {"steps": steps, "tensors": len(reduces), "fused_per_step": fused / steps if steps else 0.0,
            "tensors_per_fused": len(reduces) * steps / fused if fused else 0.0,
            "step_ms": 1e3 * statistics.median(gaps) if gaps else 0.0}


@check(points=6, needs_run=True)
def fusion_sweep_is_the_timelines(r):
    """Exercise 4: the readings and the choice are what the sweep's own timelines show, and each timeline shows its
    setting at work (no two tensors fused at threshold 0; coordinator cycles no shorter than the cycle time)."""
    work, readings, again = _workdir(r), r["fusion_readings"], {}
    assert [(p["threshold_mb"], p["cycle_ms"], p["timeline"]) for p in readings] == \
        [(p["threshold_mb"], p["cycle_ms"], p["timeline"]) for p in r["fusion_sweep"]], "read every sweep point"
    for p in readings:
        what = f"threshold {p['threshold_mb']} MiB, cycle {p['cycle_ms']} ms"
        try:
            timeline = horovod_timeline_text(read_run_file(work, p["timeline"]))
        except Exception as e:  # missing, a link, too big, not a timeline: all the student's files
            raise AssertionError(f"{what}: its timeline could not be read ({type(e).__name__}: {e})") from None
        found = again[(p["threshold_mb"], p["cycle_ms"])] = sweep_reading(timeline)
        assert found["steps"] >= 2, f"{what}: fewer than 2 complete steps in the timeline"
        for key in ("steps", "tensors"):
            assert p[key] == found[key], f"{what}: {key} {p[key]!r}, the timeline shows {found[key]}"
        for key in ("fused_per_step", "tensors_per_fused", "step_ms"):
            close(found[key], p[key], what=f"{what}: {key}")
        ranks = _read_json(work, f"{p['run_dir']}/result-0-0.json")  # rank 0 reports the settings it ran under
        assert (ranks["fusion_threshold"], ranks["cycle_time"]) == (str(int(p["threshold_mb"] * 2**20)),
                                                                    f"{p['cycle_ms']:g}"), f"{what}: ran {ranks}"
        if p["threshold_mb"] == 0:
            assert found["tensors_per_fused"] == 1, f"{what}: tensors were fused: not a threshold-0 run"
        cycles = timeline["cycles"]
        gap = 1e3 * statistics.median(b - a for a, b in zip(cycles, cycles[1:])) if len(cycles) > 2 else 0.0
        assert gap >= 0.8 * p["cycle_ms"], f"{what}: its cycles are {gap:.2f} ms apart: not this cycle time"
    best = min(again, key=lambda k: again[k]["step_ms"])
    choice = r["fusion_choice"]
    assert (choice["threshold_mb"], choice["cycle_ms"]) == best, \
        f"the choice {choice} is not the point with the shortest step in the timelines: {best}"
