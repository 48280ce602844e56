"""Lab 02 hidden checks: the LaunchPanel runs against their event files; the exercises recomputed from the raw
records.

Only the LaunchPanel runs and the profiled DDP run write events. The allreduce timings, the gradient comparison,
the bucket sweep and the replicas come back from the SpMD pool's ranks as return values, so they are held against
each other only; the bucket sweep's traces and the DDP run's traces are files in the working copy, which the grader
re-reads (no link followed) to re-derive the exercise's numbers and the timeline's. Every check needs a real run
(`needs_run`).
"""
import json
import math

from scalelab.experiments.profiling import merge, overlap_seconds, read_run_file, trace_intervals, trace_summary
from scalelab.grade.checks import check, close, evidence, param
from scalelab.grade.evidence import RUNS, WORKDIR


def _intervals(r, path: str) -> dict:
    """A trace the notebook's run wrote, read by the grader from the working copy."""
    work = r[WORKDIR]
    try:
        return trace_intervals(json.loads(read_run_file(work, path)))
    except Exception as e:  # missing, a link, too big, not a trace: all the student's files
        raise AssertionError(f"the trace {path} could not be read ({type(e).__name__}: {e})") from None


@check(points=2, needs_run=True)
def busbw_recomputed(r):
    """busbw of every row follows from the recorded times and world size."""
    n = r["allreduce"]["world"]
    for raw, row in zip(r["allreduce"]["rows"], r["allreduce_bw"]):
        want = raw["bytes"] / raw["time_s"] / 1e9 * 2 * (n - 1) / n
        assert row["bytes"] == raw["bytes"] and math.isclose(row["busbw_GBps"], want, rel_tol=1e-6)


@check(points=0.5, needs_run=True)
def large_messages_reach_higher_bandwidth(r):
    """The largest message moves more bytes per second than the smallest (latency is amortised)."""
    rows = r["allreduce"]["rows"]
    small, large = rows[0], rows[-1]
    assert large["bytes"] / large["time_s"] > small["bytes"] / small["time_s"]


@check(points=1, needs_run=True)
def ranks_trained_on_different_shards(r):
    """In the by-hand comparison, ranks saw different data (different losses) but share one world."""
    rows = r["by_hand"]
    assert len(rows) == rows[0]["world"] >= 2 and [x["rank"] for x in rows] == list(range(len(rows)))
    assert rows[0]["losses"] != rows[1]["losses"], "every rank reported the same losses"


@check(points=2, needs_run=True)
def ring_bytes_recomputed(r):
    """ring_bytes_per_rank = 2(N-1)/N x gradient bytes per step."""
    b = r["buckets"]
    want = 2 * (b["world"] - 1) / b["world"] * b["rows"][0]["bytes_per_step"]
    assert math.isclose(r["ring_bytes_per_rank"], want, rel_tol=1e-9)


@check(points=0.5, needs_run=True)
def gradient_bytes_match_the_model(r):
    """DDP reduces 4 bytes (fp32) per parameter per step."""
    b = r["buckets"]
    assert all(row["bytes_per_step"] == 4 * b["parameters"] for row in b["rows"])


@check(points=0.5, needs_run=True)
def panel_runs_are_the_engine_runs(r):
    """Each LaunchPanel run's world size, samples/s (global and per rank), final loss and loss curve are what its
    event files show."""
    for x in r["panel_runs"]:
        found = evidence(r, x["run_dir"], total_steps="panel_steps")
        assert found["world_size"] == x["workers"], f"{x['workers']} workers recorded, {found['world_size']} ran"
        close(found["samples_per_s"], x["samples_per_s"], what=f"{x['workers']}-worker samples/s")
        assert len(found["per_rank_samples_per_s"]) == len(x["per_rank"]), "one samples/s per rank"
        for a, b in zip(found["per_rank_samples_per_s"], x["per_rank"]):
            close(a, b, what=f"{x['workers']}-worker per-rank samples/s")
        close(found["final_loss"], x["final_loss"], what=f"{x['workers']}-worker final loss")
        assert found["loss_curve"] == x["loss_curve"], f"the {x['workers']}-worker loss curve is not the run's"


@check(points=2, needs_run=True)
def efficiency_recomputed(r):
    """efficiency = samples/s(N) / (N x samples/s(1)) of the panel runs, as their event files show them."""
    one, many = r["panel_runs"][0], r["panel_runs"][-1]
    rate_1, rate_n = (evidence(r, x["run_dir"])["samples_per_s"] for x in (one, many))
    close(rate_n / (many["workers"] * rate_1), r["efficiency"], what="efficiency")


@check(points=0.5, needs_run=True)
def global_throughput_is_the_sum_of_ranks(r):
    """Each run's samples/s is the sum of its ranks' samples/s."""
    for x in r["panel_runs"]:
        assert math.isclose(x["samples_per_s"], sum(x["per_rank"]), rel_tol=1e-6)


@check(points=0.5, needs_run=True)
def ddp_timeline_is_the_engine_run(r):
    """The timeline's run is a DDP engine run (its events), and every rank's all-reduces, comm ms and overlap are
    what its trace shows."""
    t = r["ddp_timeline"]
    found = evidence(r, t["run_dir"])
    assert found["strategy"] == "ddp" and found["world_size"] == len(t["ranks"]), \
        f"the events are of a {found['world_size']}-rank {found['strategy']} run"
    for rank, x in t["ranks"].items():
        s = trace_summary(_intervals(r, f"{t['run_dir']}/traces/rank-{int(rank)}.json"))
        assert s["collectives"].get("all_reduce", 0) == x["allreduces"], f"rank {rank}: all-reduces"
        close(1e3 * s["comm_s"] / s["steps"], x["comm_ms"], what=f"rank {rank} comm ms")
        close(s["overlap"], x["overlap"], what=f"rank {rank} overlap")


@check(points=4, needs_run=True)
def bucket_overlap_is_the_traces(r):
    """Exercise 4 re-derived from the sweep's traces: all-reduces (= buckets x traced steps), comm and hidden ms."""
    assert r[RUNS] is not None  # the traces count once the notebook's engine runs do
    rows = {x["bucket_cap_mb"]: x for x in r["buckets"]["rows"]}
    for x in r["bucket_overlap"]:
        row = rows[x["bucket_cap_mb"]]
        iv = _intervals(r, row["trace"])
        comm, steps = merge((a, b) for _, a, b, _ in iv["comm"]), len(iv["steps"])
        assert len(iv["comm"]) == x["allreduces"] == row["buckets"] * steps, \
            f"cap {x['bucket_cap_mb']} MB: {len(iv['comm'])} all-reduces traced over {steps} steps"
        close(1e3 * sum(b - a for a, b in comm) / steps, x["comm_ms"], what=f"cap {x['bucket_cap_mb']} comm ms")
        close(1e3 * overlap_seconds(comm, iv["compute"]) / steps, x["hidden_ms"],
              what=f"cap {x['bucket_cap_mb']} hidden ms")


# --- section 7: gradient compression. Bytes and losses come from each run's own step events, never from the
# notebook's numbers; the run must have imported the student's module (its code/ copy is named in the events).
EF_BAND = 0.35
"""Top-k with error feedback: its tail loss (mean of the last steps) at most this much above the all-reduce's."""
NO_EF_GAP = 0.25
"""Top-k without error feedback: its tail loss at least this much above the error-feedback run's."""


def _compressed(r, name: str) -> dict:
    """The named compression run's evidence (its event files), with the run's tail loss."""
    from scalelab.experiments.compression import tail_loss
    row = next((x for x in r["compression"] if x["name"] == name), None)
    assert row is not None, f"no compression run named {name!r}"
    assert "error" not in row, f"the {name} run did not run: {row['error']}"
    found = evidence(r, row["run_dir"])
    assert found["world_size"] >= 2, f"the {name} run had {found['world_size']} rank: compression needs 2 or more"
    assert found["wire_bytes_per_step"], f"the {name} run's events count no bytes sent"
    return {**found, "tail": tail_loss(found["loss_curve"])}


def _yours(found: dict, hook: str, module: str) -> None:
    assert found["comm_hook"] == hook, f"the run used comm_hook {found['comm_hook']!r}, not {hook!r}"
    assert module in found["code"], f"the run did not import your {module} (its code/ folder holds {sorted(found['code'])})"


@check(points=8, needs_run=True)
def cast_hook_halves_the_bytes(r):
    """Exercise 6, from the runs' events: your fp16 hook ran in every rank, each rank sent at most 55 % of the fp32
    all-reduce's bytes per step, and the loss stayed within 0.1 of the all-reduce's."""
    plain, cast = _compressed(r, "allreduce"), _compressed(r, "fp16")
    _yours(cast, "my_cast:fp16_hook", "my_cast.py")
    share = cast["wire_bytes_per_step"] / plain["wire_bytes_per_step"]
    assert share <= 0.55, f"your cast hook's ranks sent {100 * share:.0f} % of the all-reduce's bytes (fp16: 50 %)"
    assert abs(cast["tail"] - plain["tail"]) <= 0.1, \
        f"loss {cast['tail']:.3f} against the all-reduce's {plain['tail']:.3f}: a cast should not change training"


@check(points=6, needs_run=True)
def topk_sends_under_two_percent(r):
    """Exercise 7, from the run's events: your top-k hook (ratio 1 %) ran in every rank, and each rank sent at most
    2 % of the all-reduce's bytes per step at 2 ranks (N/2 x 2 % at N ranks: an all-gather grows with N)."""
    plain, topk = _compressed(r, "allreduce"), _compressed(r, "topk_ef")
    _yours(topk, "my_topk:topk_hook", "my_topk.py")
    share = topk["wire_bytes_per_step"] / plain["wire_bytes_per_step"]
    limit = 0.02 * topk["world_size"] / 2
    assert share <= limit, f"your top-k ranks sent {100 * share:.2f} % of the all-reduce's bytes (at most " \
                           f"{100 * limit:.0f} % at {topk['world_size']} ranks: fp16 values and int32 positions)"


@check(points=8, needs_run=True)
def error_feedback_keeps_the_loss(r):
    """Exercise 7, from the runs' events: with error feedback the top-k run's loss (mean of its last steps) is within
    0.35 of the all-reduce's; without it, at least 0.25 worse than with it."""
    plain, ef, no_ef = (_compressed(r, n) for n in ("allreduce", "topk_ef", "topk_no_ef"))
    _yours(ef, "my_topk:topk_hook", "my_topk.py")
    assert ef["tail"] <= plain["tail"] + EF_BAND, \
        f"with error feedback the loss is {ef['tail']:.3f}, more than {EF_BAND} above the all-reduce's " \
        f"{plain['tail']:.3f}: is the residual added to the next step's gradient?"
    assert no_ef["tail"] >= ef["tail"] + NO_EF_GAP, \
        f"without error feedback the loss is {no_ef['tail']:.3f}, with it {ef['tail']:.3f}: the two runs do not " \
        "differ (does your hook read state.error_feedback?)"


@check(points=0.5, needs_run=True)
def compression_rows_are_the_runs(r):
    """The bytes and losses the notebook shows for the compression runs are their event files'."""
    from scalelab.experiments.compression import tail_loss
    for row in r["compression"]:
        if "error" in row:
            continue
        found = evidence(r, row["run_dir"])
        close(found["wire_bytes_per_step"], row["wire_bytes"], what=f"{row['name']} bytes per step")
        close(tail_loss(found["loss_curve"]), row["tail_loss"], what=f"{row['name']} loss")
