"""Lab 01 public checks: what a student can self-check on the numbers the notebook recorded."""
from scalelab.experiments.timing import TOLERANCE
from scalelab.grade.checks import check, partial


def _rate(value, what):
    assert isinstance(value, (int, float)) and value > 0, f"{what} must be a positive number of samples/s, got {value!r}"
    return float(value)


@check(points=1, needs_run=True)
def baseline_measured(r):
    """The engine's baseline run and the in-process measurement both produced a throughput."""
    _rate(r["baseline_samples_per_s"], "baseline_samples_per_s")
    _rate(r["inprocess_full_sps"], "inprocess_full_sps")


@check(points=2, needs_run=True)
def timer_is_honest(r):
    """Exercise 1: on the probe device your timer reads the work of the timed steps: warm-up left out, device waited for."""
    p = r["timer_probe"]
    want = p["steps"] + p["warmup"]
    assert p["calls"] == want, f"your timer called step() {p['calls']} times: call it warmup + steps = {want} times"
    measured, honest = p["measured_ms"], p["honest_ms"]
    assert measured >= (1 - TOLERANCE) * honest, (
        f"your timer read {measured:.3f} ms per step, but the device worked {honest:.2f} ms per timed step: the clock "
        "stopped before the work was done; call sync() before you read the clock, at the start and at the end")
    assert measured <= (1 + TOLERANCE) * honest, (
        f"your timer read {measured:.2f} ms per step, but the timed steps' work took {honest:.2f} ms each: leave the "
        "warm-up calls off the clock, and wait for their work (sync()) before you start it")


@check(points=1, needs_run=True)
def step_split_measured(r):
    """Data-only, compute-only and full throughput were all measured."""
    split = r["split"]
    for k in ("data", "compute", "full"):
        _rate(split.get(k), f"split[{k!r}]")


@check(points=2, needs_run=True)
def full_step_predicted(r):
    """Exercise 2: the prediction lies where a serial step must: between min(data, compute)/2 and min(data, compute)."""
    pred, split = _rate(r["predicted_full_sps"], "predicted_full_sps"), r["split"]
    slowest = min(split["data"], split["compute"])
    assert slowest / 2 * 0.999 <= pred <= slowest * 1.001, (
        f"predicted {pred:.0f} samples/s, but a step that loads ({split['data']:.0f}/s) and then computes "
        f"({split['compute']:.0f}/s) runs between {slowest / 2:.0f} and {slowest:.0f}: add the times per sample")


@check(points=1, needs_run=True)
def bottleneck_named(r):
    """Exercise 2: the bottleneck is the slower of data and compute."""
    split = r["split"]
    want = "data" if split["data"] < split["compute"] else "compute"
    assert r["bottleneck"] == want, f"bottleneck is {r['bottleneck']!r}, but data runs at {split['data']:.0f} " \
                                    f"and compute at {split['compute']:.0f} samples/s"


@check(points=1, needs_run=True)
def loader_workers_help(r):
    """With storage latency, some number of loader workers beats loading in the training process."""
    rows = {row["workers"]: row["samples_per_s"] for row in r["loader_sweep"]}
    assert 0 in rows and len(rows) >= 2, f"sweep loader_workers over 0 and at least one more count, got {sorted(rows)}"
    best = max(v for w, v in rows.items() if w > 0)
    assert best >= 1.3 * rows[0], f"best with workers {best:.0f} vs {rows[0]:.0f} samples/s without: expected a " \
                                  "clear gain when every sample waits for storage (is read_ms > 0?)"


@check(points=2, needs_run=True)
def workers_chosen(r):
    """Exercise 3: the chosen worker count reaches 90 % of the best throughput measured."""
    rows = {row["workers"]: row["samples_per_s"] for row in r["loader_sweep"]}
    w = r["chosen_workers"]
    assert w in rows, f"chosen_workers={w!r} is not one of the swept counts {sorted(rows)}"
    assert rows[w] >= 0.9 * max(rows.values()), f"{w} workers reach {rows[w]:.0f} samples/s, below 90 % of the " \
                                                f"best ({max(rows.values()):.0f})"


@check(points=1, needs_run=True)
def precisions_compared(r):
    """At least two precisions were measured and reach nearly the same loss."""
    rows = r["precision"]
    assert len(rows) >= 2 and rows[0]["precision"] == "fp32", "compare fp32 (first) with bf16 or fp16"
    for row in rows:
        _rate(row["samples_per_s"], f"{row['precision']} samples_per_s")
        assert row["loss_diff"] < 0.05, f"{row['precision']} ends at loss {row['loss']:.4f}, " \
                                        f"{row['loss_diff']:.4f} away from fp32: too far for mixed precision"


@check(points=2, needs_run=True)
def own_step_is_mixed_precision(r):
    """Exercise 4: your step ran under autocast (16-bit activations), kept fp32 weights, used the GradScaler once per
    step (fp16) and ended within 0.05 of the fp32 step's loss."""
    own = r["own_step"]
    yours = own["yours"]
    share = yours["low_precision_share"]
    assert share >= 0.5, f"only {100 * share:.0f} % of what autograd kept for backward was 16-bit: is autocast on, " \
                         "for x's device type (x.device.type), around the forward pass?"
    assert yours["param_dtypes"] == ["torch.float32"], f"the weights ended as {yours['param_dtypes']}: keep the " \
                                                       "model in fp32, autocast casts per operation"
    if own["precision"] == "fp16":
        steps = len(yours["losses"])
        assert yours["scaler_calls"] == {"scale": steps, "step": steps, "update": steps}, (
            f"over {steps} steps your step called the GradScaler {yours['scaler_calls']}: once per step, "
            "scaler.scale(loss).backward(), scaler.step(optimizer), scaler.update()")
    assert own["loss_diff"] < 0.05, f"your step ends {own['loss_diff']:.4f} away from the fp32 step's loss: too far " \
                                    "for mixed precision (are the gradients zeroed after each step?)"


@check(points=1, needs_run=True)
def compile_attempted(r):
    """torch.compile was tried: either a measured speedup or the error that stopped it."""
    c = r["compile"]
    assert c.get("backend"), "compile_backend was empty: set it (aot_eager is quick) and rerun"
    if c["ok"]:
        assert isinstance(c["speedup"], (int, float)) and c["speedup"] > 0, f"compile speedup {c['speedup']!r}"
    else:
        assert c.get("error"), "compile failed without saying why"


@check(points=1, needs_run=True)
def profile_saved(r):
    """A profiler trace was saved and its operator table recorded."""
    p = r["profile"]
    assert p["trace_events"] > 50, f"the trace holds only {p['trace_events']} events"
    assert p["ops"] and p["self_ms_total"] > 0, "the operator table is empty"


@check(points=2, needs_run=True)
def conv_share(r):
    """Exercise 5: the share of self time spent in convolutions is a fraction in (0, 1)."""
    f = r["conv_fraction"]
    assert isinstance(f, (int, float)) and 0 < f < 1, f"conv_fraction={f!r} must be in (0, 1)"


@check(points=2, needs_run=True)
def ladder_climbs(r):
    """The optimisation ladder ends faster than it started."""
    rows = r["ladder"]
    assert len(rows) >= 3, f"the ladder has {len(rows)} rungs; keep at least baseline, workers, batch"
    final = rows[-1]["speedup"]
    if final >= 1.3:
        return None
    return partial(max(0.0, (final - 1) / 0.3), f"the last rung is only {final:.2f}x the baseline")


@check(points=1, needs_run=True)
def traces_read(r):
    """The engine run was profiled before and after the fix, each trace's phase shares recorded."""
    for name in ("trace_before", "trace_after"):
        t = r[name]
        assert t["steps"] >= 1 and {"data", "forward", "backward", "optimizer"} <= set(t["shares"]), \
            f"{name} holds no profiled step with the four phases: {t['shares']}"
        assert abs(sum(t["shares"].values()) - 1) < 1e-6, f"{name}: the shares add up to {sum(t['shares'].values())}"
    assert r["trace_before"]["run_dir"] != r["trace_after"]["run_dir"], "trace the fixed run into its own folder"


@check(points=2, needs_run=True)
def fixed_phase_shrank(r):
    """Exercise 6: the slowest phase of the first trace is named, and after the fix its share fell clearly."""
    before, after = r["trace_before"]["shares"], r["trace_after"]["shares"]
    want = max(before, key=before.get)
    assert r["slowest_phase"] == want, f"slowest_phase={r['slowest_phase']!r}, but {want} leads the first trace " \
                                       f"with {100 * before[want]:.0f} %"
    assert r["trace_fix"], "fix is empty: give the RunSpec overrides that should shrink that phase"
    b, a = before[want], after.get(want, 0.0)
    assert a <= 0.8 * b, f"after {r['trace_fix']}, {want} still takes {100 * a:.0f} % of the step " \
                         f"({100 * b:.0f} % before): try another fix"
