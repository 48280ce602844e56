"""Forged submissions of the real labs (labs 01-06), made from the reference notebook by replacing its code cells:
what a student who runs nothing would hand in. test_grade_forgery.py says what each forgery proves; the shared lab
gradings (labtests.LabGradings) grade them in each lab's batch, beside its reference and student copy."""
from __future__ import annotations

import json
from pathlib import Path

# A forger's helper: event files that look like the engine's (start, steps, checkpoints, end), written at once.
FAKE_EVENTS = '''
import json, time
from pathlib import Path

def fake_run(run_dir, world=1, losses=(1.4, 1.3, 1.2), batch=32, step_s=0.004, every=0, blocked_s=0.0,
             start_step=0, mode="sync", strategy="ddp", data_fraction=0.0, start_extra=None, step_extra=None):
    events = Path(run_dir) / "events"
    events.mkdir(parents=True, exist_ok=True)
    total = start_step + len(losses)
    for rank in range(world):
        with open(events / f"rank-{rank}.jsonl", "a") as f:
            def emit(**e):
                f.write(json.dumps({"rank": rank, "t": time.time(), **e}) + "\\n")
            emit(type="start", world_size=world, start_step=start_step, total_steps=total, strategy=strategy,
                 **(start_extra or {}))
            for step, loss in enumerate(losses, start_step + 1):
                emit(type="step", step=step, loss=loss, lr=0.05, samples=batch, step_s=step_s,
                     data_s=data_fraction * step_s, compute_s=(1 - data_fraction) * step_s, comm_s=0.0,
                     samples_per_s=batch / step_s, **(step_extra or {}))
                if every and step % every == 0 and step < total:
                    emit(type="checkpoint", step=step, metric=loss, blocked_s=blocked_s, mode=mode)
            emit(type="end", steps=total, final_loss=losses[-1], eval_accuracy=0.5, elapsed_s=step_s * len(losses))

def fake_trace(path, ranges):
    """A Chrome trace like torch.profiler's from (name, start ms, duration ms) ranges: aten ops and the
    scalelab:<phase> and ProfilerStep#<n> ranges on the training thread, gloo:<op> ranges on gloo's thread."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    events = [{"ph": "X", "name": name, "cat": "cpu_op" if name.startswith("aten::") else "user_annotation",
               "ts": 1e3 * start, "dur": 1e3 * dur, "pid": 1, "tid": 2 if name.startswith("gloo:") else 1}
              for name, start, dur in ranges]
    path.write_text(json.dumps({"traceEvents": events}))
'''

LAB01 = '''
batch, step_s = 32, 0.0064  # the engine baseline: 5000 samples/s
record("baseline_samples_per_s", batch / step_s)
record("baseline_run_dir", "runs/lab01/baseline")
record("inprocess_full_sps", 4800.0)
split = {"data": 700.0, "compute": 3000.0, "full": 560.0}
record("split", split)
record("predicted_full_sps", 1 / (1 / split["data"] + 1 / split["compute"]))
record("bottleneck", "data")
record("loader_sweep", [{"workers": 0, "samples_per_s": 600.0}, {"workers": 2, "samples_per_s": 1500.0},
                        {"workers": 4, "samples_per_s": 1600.0}])
record("chosen_workers", 2)
record("precision", [{"precision": "fp32", "samples_per_s": 600.0, "speedup": 1.0, "loss": 1.30, "loss_diff": 0.0},
                     {"precision": "bf16", "samples_per_s": 500.0, "speedup": 500 / 600, "loss": 1.31,
                      "loss_diff": 0.01}])
record("compile", {"backend": "aot_eager", "ok": True, "speedup": 1.05, "error": None})
ops = [{"name": "aten::convolution", "self_ms": 30.0, "calls": 10}, {"name": "aten::mm", "self_ms": 10.0, "calls": 10}]
record("profile", {"ops": ops, "self_ms_total": 60.0, "trace_events": 500, "steps": 3})
record("conv_fraction", 30.0 / 60.0)
rates = [("baseline", 600.0), ("2 loader workers", 1500.0), ("batch 128", 2400.0)]
record("ladder", [{"name": n, "samples_per_s": v, "speedup": v / rates[0][1], "gain": v / rates[max(i - 1, 0)][1]}
                  for i, (n, v) in enumerate(rates)])
gpt = [("fp32, AdamW", 50000.0), ("bf16 autocast", 52000.0), ("fused AdamW", 56000.0)]
record("gpt_ladder", [{"name": n, "tokens_per_s": v, "speedup": v / gpt[0][1], "gain": v / gpt[max(i - 1, 0)][1],
                       "loss_first": 5.57, "loss_last": 5.2} for i, (n, v) in enumerate(gpt)])
shares = {"traced": {"data": 0.74, "forward": 0.17, "backward": 0.08, "optimizer": 0.01},
          "traced-fixed": {"data": 0.12, "forward": 0.17, "backward": 0.68, "optimizer": 0.03}}
for name, (key, run) in zip(("trace_before", "trace_after"), shares.items()):
    record(name, {"run_dir": f"runs/lab01/{key}", "steps": 3, "shares": run,
                  "ms_per_step": {p: 40 * v for p, v in run.items()}})
record("slowest_phase", "data")
record("trace_fix", {"data.format": "shards"})
if EVENTS:
    fake_run("runs/lab01/baseline", losses=[1.4 - 0.01 * i for i in range(20)], batch=batch, step_s=step_s)
    for key, run in shares.items():
        fake_run(f"runs/lab01/{key}", losses=[1.4, 1.3, 1.2, 1.1, 1.0], batch=batch, step_s=0.04,
                 data_fraction=run["data"])
        ranges, t = [], 0.0
        for step in range(1, 4):  # each profiled step: its phases end to end
            ranges.append((f"ProfilerStep#{step}", t, 40.0))
            for phase, share in run.items():
                ranges.append((f"scalelab:{phase}", t, 40 * share))
                t += 40 * share
        fake_trace(f"runs/lab01/{key}/traces/rank-0.json", ranges)
# the code exercises: a timer probe's log and two step runs, each with "the code that ran", all typed
import hashlib
from scalelab.experiments.own_step import low_precision_share
from scalelab.experiments.timing import probe_verdict
timer_text = "def time_steps(step, steps, warmup, sync):\\n    return 0.0102\\n"
log = [{"type": "start", "timer": "my_timer:time_steps", "steps": 20, "warmup": 3, "work_ms": 10.0,
        "warmup_ms": 100.0, "code": {"my_timer.py": hashlib.sha256(timer_text.encode()).hexdigest()}}]
for i in range(23):
    t0 = 0.1 * i if i < 3 else 0.3 + 0.0101 * (i - 3)
    log += [{"type": "call", "what": "step", "i": i, "t0": t0, "t1": t0 + 1e-6},
            {"type": "work", "i": i, "t0": t0, "t1": t0 + (0.1 if i < 3 else 0.0101)}]
log.append({"type": "result", "seconds_per_step": 0.0102})
record("timer_probe", {"run_dir": "runs/lab01/timer-probe", **probe_verdict(log)})
step_text = "def train_step(model, optimizer, x, y, dtype, scaler):\\n    return 1.3\\n"
saved = {"fp32": {"torch.float32": 891652, "torch.int64": 196864},
         "fp16": {"torch.float16": 445968, "torch.float32": 4616, "torch.int64": 196864}}
own = {}
for name, key, shift in (("fp32", "fp32", 0.0), ("fp16", "yours", 0.0005)):
    losses = [1.40 - 0.01 * i + shift for i in range(8)]
    own[key] = {"run_dir": f"runs/lab01/own-step/{name}", "losses": losses, "final_loss": losses[-1],
                "saved_bytes": saved[name], "low_precision_share": low_precision_share(saved[name]),
                "param_dtypes": ["torch.float32"], "step_ms": 6.0,
                "scaler_calls": {"scale": 8, "step": 8, "update": 8} if name == "fp16" else None}
record("own_step", {**own, "precision": "fp16", "loss_diff": abs(own["yours"]["final_loss"] - own["fp32"]["final_loss"])})
if EVENTS:
    Path("my_timer.py").write_text(timer_text)
    Path("runs/lab01/timer-probe").mkdir(parents=True, exist_ok=True)
    Path("runs/lab01/timer-probe/probe.jsonl").write_text("".join(json.dumps(e) + "\\n" for e in log))
    Path("my_step.py").write_text(step_text)
    for name, run in (("fp32", own["fp32"]), ("fp16", own["yours"])):
        events = Path(run["run_dir"]) / "events"
        events.mkdir(parents=True, exist_ok=True)
        with open(events / "rank-0.jsonl", "w") as f:
            def emit(**e):
                f.write(json.dumps({"rank": 0, "t": time.time(), **e}) + "\\n")
            code = {"my_step.py": hashlib.sha256(step_text.encode()).hexdigest()} if name == "fp16" else {}
            emit(type="start", world_size=1, start_step=0, total_steps=8, strategy="single", precision=name, code=code)
            emit(type="memory", step=1, saved_bytes=run["saved_bytes"])
            for step, loss in enumerate(run["losses"], 1):
                emit(type="step", step=step, loss=loss, samples=32, step_s=0.006, data_s=0.0, compute_s=0.006,
                     comm_s=0.0, samples_per_s=32 / 0.006)
            emit(type="end", steps=8, final_loss=run["losses"][-1], elapsed_s=0.048, param_dtypes=["torch.float32"],
                 scaler_calls=run["scaler_calls"])
'''

LAB02 = '''
rows = [{"bytes": 1024, "time_s": 1e-4}, {"bytes": 65536, "time_s": 3e-4}, {"bytes": 4194304, "time_s": 8e-3}]
record("allreduce", {"world": 2, "backend": "gloo", "sum_ok": True, "rows": rows})
record("allreduce_bw", [{**r, "algbw_GBps": r["bytes"] / r["time_s"] / 1e9,
                         "busbw_GBps": r["bytes"] / r["time_s"] / 1e9 * 2 * (2 - 1) / 2} for r in rows])
record("alpha_beta", {"latency_us": 90.0, "bandwidth_GBps": 0.5})
record("by_hand", [{"rank": r, "world": 2, "grad_max_diff": 0.0, "param_max_diff": 0.0, "replica_max_diff": 0.0,
                    "losses": [1.3 + 0.1 * r, 1.2, 1.1]} for r in range(2)])
P = 500_000
traces = {c: f"runs/lab02/bucket_traces/cap-{c}.json" for c in (0.1, 0.5, 25.0)}  # rank 0's at each cap
record("buckets", {"world": 2, "parameters": P, "rows": [{"bucket_cap_mb": c, "buckets": b, "bytes_per_step": 4 * P,
                                                          "trace": traces[c]} for c, b in ((0.1, 6), (0.5, 3), (25.0, 1))]})
record("ring_bytes_per_rank", 2 * (2 - 1) / 2 * 4 * P)
record("accumulation", {"k": 4, "calls_naive": 8, "calls_no_sync": 2, "grad_max_diff": 0.0})
record("replicas", [{"rank": r, "ddp": {"max_diff_from_rank0": 0.0}, "no_averaging": {"max_diff_from_rank0": 0.01 * r}}
                    for r in range(2)])
losses, batch, step_s = [1.4 - 0.01 * i for i in range(20)], 32, 0.008
runs = []
for n in (1, 2):
    run_dir = f"runs/lab02/panel/panel-{n}w"
    runs.append({"workers": n, "samples_per_s": n * batch / step_s, "per_rank": [batch / step_s] * n,
                 "final_loss": losses[-1], "loss_curve": losses, "run_dir": run_dir})
    if EVENTS:
        fake_run(run_dir, world=n, losses=losses, batch=batch, step_s=step_s)
record("panel_runs", runs)
record("efficiency", runs[1]["samples_per_s"] / (2 * runs[0]["samples_per_s"]))
record("ddp_timeline", {"run_dir": "runs/lab02/ddp-traced", "ranks": {str(r): {"steps": 3, "allreduces": 6,
                                                                               "comm_ms": 5.0, "overlap": 0.2}
                                                                        for r in range(2)}})
caps = ((0.1, 6, 20.0, 2.0), (0.5, 3, 6.0, 1.0), (25.0, 1, 5.0, 0.5))  # cap, buckets, comm and hidden ms per step
overlap = [{"bucket_cap_mb": c, "allreduces": 3 * b, "comm_ms": m, "hidden_ms": h, "exposed_ms": m - h,
            "overlap": h / m} for c, b, m, h in caps]
record("bucket_overlap", overlap)
record("least_exposed_cap", 25.0)

def ddp_trace(path, allreduces, comm_ms, hidden_ms, steps=3):
    # each step: 10 ms of compute, then its all-reduces back to back, the first hidden_ms of them under the compute
    ranges, t = [], 0.0
    for step in range(1, steps + 1):
        ranges += [(f"ProfilerStep#{step}", t, 10 + comm_ms), ("aten::addmm", t, 10.0)]
        ranges += [("gloo:all_reduce", t + 10 - hidden_ms + k * comm_ms / allreduces, comm_ms / allreduces)
                   for k in range(allreduces)]
        t += 10 + comm_ms
    fake_trace(path, ranges)

if EVENTS:
    fake_run("runs/lab02/ddp-traced", world=2, losses=losses[:6], batch=batch, step_s=step_s)
    for rank in range(2):
        ddp_trace(f"runs/lab02/ddp-traced/traces/rank-{rank}.json", 2, 5.0, 0.2 * 5.0)
    for c, b, m, h in caps:
        ddp_trace(traces[c], b, m, h)

# section 7: five compression runs whose events show the bytes and losses the checks want
hooks = {"allreduce": ("allreduce", None, 340008, 0.0), "fp16": ("my_cast:fp16_hook", "my_cast.py", 170004, 0.0),
         "powersgd": ("powersgd", None, 6480, 0.1), "topk_ef": ("my_topk:topk_hook", "my_topk.py", 5100, -0.02),
         "topk_no_ef": ("my_topk:topk_hook", "my_topk.py", 5100, 1.0)}
compressed = []
for name, (hook, module, sent, worse) in hooks.items():
    curve = [1.4 - 0.01 * i + worse for i in range(20)]
    run_dir = f"runs/lab02/compression/{name}"
    compressed.append({"name": name, "comm_hook": hook, "run_dir": run_dir, "wire_bytes": sent, "collectives": 1,
                       "step_ms": 8.0, "loss_curve": curve, "tail_loss": sum(curve[-10:]) / 10, "eval_accuracy": 0.8})
    if EVENTS:
        fake_run(run_dir, world=2, losses=curve, batch=batch, step_s=step_s,
                 start_extra={"comm_hook": hook, "code": {module: "0" * 64} if module else {}},
                 step_extra={"wire_bytes": sent, "comm_bytes": sent, "collectives": 1})
record("compression", compressed)
'''

LAB06 = '''
from scalelab.ckpt.retention import select
every, workers = 4, 2
record("kill_test", {"run_dir": "runs/lab06/kill", "code": {"my_ckpt.py": "0" * 64}, "kill_at": 12, "every": 4,
                     "steps": 20, "killed_in_save": True, "save_ok": True, "restore_ok": True, "resume_ok": True,
                     "save_problems": [], "restore_problems": [], "resume_problems": []})
record("lab06_params", {"workers": workers, "every": every, "steps": 20, "modes": ["sync", "async", "sharded"],
                        "resume_steps": 16, "stop_after": 10, "slice_steps": 28})
record("anatomy", {"files": ["step-4.pt", "step-8.pt.tmp"], "latest": "step-4.pt",
                   "partial_error": "step-8.pt.tmp may be partial", "corrupt_error": "step-4.pt is corrupted",
                   "corrupt_file": "runs/lab06/anatomy/step-4.pt"})
record("manifest_entry", {"step": 4, "file": "step-4.pt", "checksum": "crc32:0badf00d"})
record("my_checksum", "crc32:0badf00d")
losses = [1.4 - 0.01 * i for i in range(20)]
blocked = {"sync": 0.4, "async": 0.04, "sharded": 0.2}
modes = {m: {"mode": m, "checkpoints": 4, "blocked_s": 4 * b, "blocked_fraction": 0.1, "flush_s": 0.1,
             "train_s": 1.0, "max_block_s": b} for m, b in blocked.items()}
record("modes", modes)
record("mode_run_dirs", {m: f"runs/lab06/mode-{m}" for m in modes})
record("stall_ratio", modes["async"]["blocked_s"] / modes["sync"]["blocked_s"])
record("least_blocking", "async")
whole = losses[:16]
record("resume", {"start_step": 8, "whole_losses": whole, "resumed_losses": whole[8:],
                  "whole_run_dir": "runs/lab06/whole", "resumed_run_dir": "runs/lab06/resumed"})
record("max_param_diff", 0.0)
record("losses_equal", True)
history = [{"step": s, "metric": losses[s - 1]} for s in (4, 8, 12, 16)]  # what the keep run's events say
record("engine_history", history)
record("kept_by_engine", [e["step"] for e in select(history, keep_last=2, keep_best=1)[0]])
record("keep_run_dir", "runs/lab06/keep")
retention = [{"step": 5 * (i + 1), "metric": m} for i, m in enumerate([2.1, 1.7, 1.9, 1.2, 1.6, 1.4, 1.3, 1.5])]
record("retention_history", retention)
record("my_kept", sorted({h["step"] for h in retention[-2:]} |
                         {h["step"] for h in sorted(retention, key=lambda h: h["metric"])[:2]}))
record("slices", {"attempts": [{"status": "timeout", "start_step": 0, "last_step": 10, "elapsed_s": 10.0},
                               {"status": "succeeded", "start_step": 8, "last_step": 28, "elapsed_s": 9.0}],
                  "identical": True, "run_dir": "runs/lab06/slices"})
if EVENTS:
    for m, b in blocked.items():
        fake_run(f"runs/lab06/mode-{m}", world=workers, losses=losses, every=every, blocked_s=b, mode=m)
    fake_run("runs/lab06/whole", world=workers, losses=whole, every=every)
    fake_run("runs/lab06/resumed", world=workers, losses=losses[:10], every=every)
    fake_run("runs/lab06/resumed", world=workers, losses=whole[8:], every=every, start_step=8)
    fake_run("runs/lab06/keep", losses=losses[:17], every=every)
    fake_run("runs/lab06/slices", losses=losses[:10], every=every)
    fake_run("runs/lab06/slices", losses=(losses * 2)[8:28], every=every, start_step=8)
'''

LAB03 = '''
port = {}
for launcher, controller in (("horovodrun", "gloo"), ("mpirun", "mpi")):
    ranks = [{"rank": r, "size": 2, "controller": controller, "replica_max_diff": 0.0, "reference_max_diff": 0.0,
              "losses": [1.3 + 0.1 * r, 1.2, 1.1], "averaged_losses": [1.35, 1.2, 1.1],
              "state_spread_before": 0.025 * r, "state_spread_after": 0.0, "state_sha256": "ab" * 32,
              "params_sha256": "cd" * 32, "not_implemented": [], "wrapped": "SGD"} for r in range(2)]
    port[launcher] = {"run_dir": f"runs/lab03/{launcher}", "ranks": ranks}
    if EVENTS:  # the ranks' own result files
        Path(port[launcher]["run_dir"]).mkdir(parents=True, exist_ok=True)
        for row in ranks:
            Path(f"{port[launcher]['run_dir']}/result-0-{row['rank']}.json").write_text(json.dumps(row))
record("port", port)
record("timeline", {"ok": True, "events": 400, "activities": {"ALLREDUCE": 40, "NEGOTIATE_ALLREDUCE": 40},
                    "tensors": ["allreduce.net.0.weight", "allreduce.net.0.bias"]})
losses, batch = [1.4 - 0.01 * i for i in range(20)], 32
runs = []
for strategy, launcher, step_s in (("ddp", "local", 0.010), ("horovod", "horovodrun", 0.016)):
    run_dir = f"runs/lab03/lab03-{strategy}-{launcher}"
    runs.append({"strategy": strategy, "launcher": launcher, "status": "succeeded", "samples_per_s": 2 * batch / step_s,
                 "per_rank_samples_per_s": [batch / step_s] * 2, "loss_curve": losses, "final_loss": losses[-1],
                 "run_dir": run_dir})
    if EVENTS:
        fake_run(run_dir, world=2, losses=losses, batch=batch, step_s=step_s, strategy=strategy)
record("engine_runs", runs)
record("comparison", {"max_loss_diff": 0.0, "hvd_over_ddp": runs[1]["samples_per_s"] / runs[0]["samples_per_s"]})
fusion = {"run_dir": runs[1]["run_dir"], "tensors": 13, "allreduces": 156, "fused_allreduces": 39,
          "tensors_per_fused": 4.0, "cycles": 1500, "negotiate_ms": 8.0, "fused_allreduce_ms": 3.0}
record("hvd_fusion", fusion)
if EVENTS:  # Horovod's timeline: a process per tensor; every 20 ms 4 tensors negotiate (8 ms), then reduce together
    timeline = [{"name": "process_name", "ph": "M", "pid": p, "args": {"name": f"allreduce.net.{p}.weight"}}
                for p in range(fusion["tensors"])]
    for k in range(fusion["allreduces"]):
        t, p = 20e3 * (k // 4), k % fusion["tensors"]
        timeline += [{"name": "NEGOTIATE_ALLREDUCE", "ph": "X", "pid": p, "tid": 1, "ts": t, "dur": 8e3},
                     {"name": "ALLREDUCE", "ph": "X", "pid": p, "tid": 1, "ts": t + 10e3, "dur": 3e3}]
    timeline += [{"name": "CYCLE_START", "ph": "i", "pid": 0, "tid": 0, "ts": 200.0 * c} for c in range(1500)]
    path = Path(runs[1]["run_dir"]) / "traces" / "horovod-timeline.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(timeline))
# the fusion sweep: 4 tensors, 3 steps a point, each step's tensors fused (one all-reduce) unless the threshold is 0
sweep, readings = [], []
for mb, cycle, step_ms in ((0, 1, 12.0), (0, 10, 20.0), (128, 1, 8.0), (128, 10, 20.0)):
    run_dir = f"runs/lab03/fusion/fusion-{mb}mb-cycle-{cycle}ms"
    point = {"threshold_mb": mb, "cycle_ms": cycle, "run_dir": run_dir, "timeline": f"{run_dir}/timeline.json",
             "step_ms_rank0": step_ms}
    sweep.append(point)
    readings.append({**point, "steps": 3, "tensors": 4, "fused_per_step": 4.0 if mb == 0 else 1.0,
                     "tensors_per_fused": 1.0 if mb == 0 else 4.0, "step_ms": step_ms})
    if EVENTS:
        spans = [{"name": "process_name", "ph": "M", "pid": p, "args": {"name": f"allreduce.net.{p}.weight"}}
                 for p in range(4)]
        for k in range(3):
            t0 = 1e5 + k * 1e3 * step_ms
            for p in range(4):
                start = t0 + 3e3 + (500 * p if mb == 0 else 0)
                spans += [{"name": "NEGOTIATE_ALLREDUCE", "ph": "X", "pid": p, "tid": 1, "ts": t0, "dur": 2e3},
                          {"name": "ALLREDUCE", "ph": "X", "pid": p, "tid": 1, "ts": start, "dur": 400}]
        spans += [{"name": "CYCLE_START", "ph": "i", "pid": 0, "tid": 0, "ts": 1e3 * cycle * c} for c in range(60)]
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        Path(point["timeline"]).write_text(json.dumps(spans))
        Path(f"{run_dir}/result-0-0.json").write_text(json.dumps({"fusion_threshold": str(mb * 2**20),
                                                                  "cycle_time": str(cycle)}))
record("fusion_sweep", sweep)
record("fusion_readings", readings)
best = min(readings, key=lambda p: p["step_ms"])
record("fusion_choice", {"threshold_mb": best["threshold_mb"], "cycle_ms": best["cycle_ms"]})
'''

LAB04 = '''
losses = [1.4 - 0.01 * i for i in range(15)]
def sweep(points, name):
    rows, dirs = [], []
    for workers, bpw, step_s in points:
        run_dir = f"runs/lab04/sweeps/scaling-weak-{workers}w-{bpw}b"  # a shared point is one run
        sps = workers * bpw / step_s
        rows.append({"workers": workers, "batch_per_worker": bpw, "global_batch": workers * bpw, "samples_per_s": sps,
                     "per_rank_samples_per_s": [bpw / step_s] * workers, "step_s": workers * bpw / sps,
                     "final_loss": losses[-1], "time_fraction": {"data": 0.1, "compute": 0.8, "comm": 0.1}})
        dirs.append(run_dir)
        if EVENTS and name == "weak" or EVENTS and workers == 1:
            fake_run(run_dir, world=workers, losses=losses, batch=bpw, step_s=step_s)
    for x in rows:
        x["speedup"] = x["samples_per_s"] / rows[0]["samples_per_s"]
        x["ideal_speedup"] = x["workers"] / rows[0]["workers"]
        x["efficiency"] = x["speedup"] / x["ideal_speedup"]
    record(f"{name}_rows", rows)
    record(f"{name}_run_dirs", dirs)
    return rows
sweep([(1, 128, 0.036), (2, 128, 0.042)], "weak")
strong = sweep([(1, 256, 0.070), (2, 128, 0.042)], "strong")
S, N = strong[-1]["speedup"], strong[-1]["ideal_speedup"]
e = (1 / S - 1 / N) / (1 - 1 / N)
record("karp_flatt", e)
record("amdahl_64", 1 / (e + (1 - e) / 64))
loss = {(32, "none"): 0.30, (32, "linear"): 0.30, (32, "sqrt"): 0.30, (256, "none"): 0.60, (256, "linear"): 0.35,
        (256, "sqrt"): 0.40, (1024, "none"): 1.10, (1024, "linear"): 0.90, (1024, "sqrt"): 0.70}
study = [{"batch": b, "rule": rule, "lr": 0.04 * {"none": 1, "linear": b / 32, "sqrt": (b / 32) ** 0.5}[rule],
          "steps": 24000 // b, "warmup_steps": int(0.2 * 24000 // b), "eval_loss": l, "accuracy": 1 - l / 2}
         for (b, rule), l in loss.items()]
record("lr_study", study)
record("optimizers", [{"label": f"sgd {x['rule']}", "optimizer": "sgd", "batch": 1024, "lr": x["lr"],
                       "eval_loss": x["eval_loss"], "accuracy": x["accuracy"]} for x in study if x["batch"] == 1024]
       + [{"label": o, "optimizer": o, "batch": 1024, "lr": lr, "eval_loss": 0.5, "accuracy": 0.8}
          for o, lr in (("lars", 8.0), ("lamb", 0.05))])
norms = {"b_small": 16, "b_big": 512, "g2_small": 2.0, "g2_big": 0.5}
record("noise_norms", norms)
bs, bb, gs, gb = norms["b_small"], norms["b_big"], norms["g2_small"], norms["g2_big"]
record("b_noise", ((gs - gb) / (1 / bs - 1 / bb)) / ((bb * gb - bs * gs) / (bb - bs)))
import math
def cosine(step, total, peak, warm):
    if step < warm:
        return peak * (step + 1) / warm
    return 0.5 * peak * (1 + math.cos(math.pi * min((step - warm) / max(total - 1 - warm, 1), 1.0)))
def fake_schedule_run(run_dir, lrs, losses, schedule, code, world=2, batch=64, step_s=0.01):
    events = Path(run_dir) / "events"
    events.mkdir(parents=True, exist_ok=True)
    for rank in range(world):
        with open(events / f"rank-{rank}.jsonl", "a") as f:
            def emit(**e):
                f.write(json.dumps({"rank": rank, "t": time.time(), **e}) + "\\n")
            emit(type="start", world_size=world, start_step=0, total_steps=len(losses), strategy="ddp",
                 schedule=schedule, code=code, peak_lr=max(lrs))
            for step, (lr, loss) in enumerate(zip(lrs, losses), 1):
                emit(type="step", step=step, loss=loss, lr=lr, samples=batch, step_s=step_s, data_s=0.0,
                     compute_s=step_s, comm_s=0.0, samples_per_s=batch / step_s)
            emit(type="end", steps=len(losses), final_loss=losses[-1], eval_accuracy=0.8,
                 elapsed_s=step_s * len(losses))
record("schedule_preview", {"total_steps": 50, "peak_lr": 1.0, "warmup_steps": 5,
                            "lr": [cosine(s, 50, 1.0, 5) for s in range(50)]})
peak, warm, total = 0.64, 10, 93
schedule_rows = []
for label, schedule, lrs, losses in (
        ("yours", "my_schedule:lr_at", [cosine(s, total, peak, warm) for s in range(total)],
         [2.3 - 2.0 * i / total for i in range(total)]),
        ("constant", "constant", [peak * (s + 1) / warm if s < warm else peak for s in range(total)], [1.8] * total)):
    k = max(1, total // 10)
    schedule_rows.append({"label": label, "schedule": schedule, "run_dir": f"runs/lab04/schedules/{label}",
                          "peak_lr": peak, "warmup_steps": warm, "steps": total, "tail_loss": sum(losses[-k:]) / k,
                          "eval_accuracy": 0.8})
    if EVENTS:
        fake_schedule_run(schedule_rows[-1]["run_dir"], lrs, losses, schedule,
                          {"my_schedule.py": "0" * 64} if ":" in schedule else {})
record("schedule_runs", schedule_rows)
best = [{"batch": b, "lr": 0.1, "steps": s} for b, s in ((16, 94), (32, 58), (64, 41), (128, 33), (256, 39), (512, 37))]
record("target_study", {"target": 0.5, "max_steps": 300, "warmup_steps": 5, "best": best,
                        "rows": [dict(p, limit=300) for p in best]})
xs, ys = [1 / p["batch"] for p in best], [p["steps"] for p in best]
mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
e_min = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
record("critical_batch", {"s_min": my - e_min * mx, "e_min": e_min, "b_crit": e_min / (my - e_min * mx), "points": 6})
growth = []
for label, plan, loss in (("constant", [(64, 0.16)] * 3, 0.45), ("decay", [(64, 0.16), (64, 0.04), (64, 0.01)], 0.27),
                          ("growth", [(64, 0.16), (256, 0.16), (1024, 0.16)], 0.29)):
    phases = [{"share": share, "batch": b, "lr": lr} for share, (b, lr) in zip((0.5, 0.25, 0.25), plan)]
    growth.append({"label": label, "phases": phases, "samples": 12000, "eval_loss": loss, "accuracy": 0.9,
                   "steps": sum(max(1, int(p["share"] * 12000) // p["batch"]) for p in phases)})
record("growth_vs_decay", growth)
record("lab04_nodes", 1)
record("job_run", None)
'''

LAB05 = '''
record("setup", {"samples": 200, "sample_size": 4096, "per_shard": 32, "bandwidth": 8e6, "opens_per_s": 400.0,
                 "root": "runs/lab05/data", "readers": 4})
record("scaling", {"rows": [{"readers": n, "per_reader_mb_s": 7.6 / n, "min_mb_s": 7.5 / n, "max_mb_s": 7.7 / n,
                             "total_mb_s": 7.6, "budget_mb_s": 8.0, "fair_mb_s": 8.0 / n} for n in (1, 2, 4)],
                   "log": "runs/lab05/servers/scaling/requests.jsonl"})
record("epoch_layouts", {"written": {"written": True, "files": 8, "bytes": 827000, "code": {"my_shards.py": "0" * 64},
                                     "why": ""},
                         "files": {"layout": "files", "opens": 200, "bytes": 819200, "requests": 200, "seconds": 0.6,
                                   "wrong_bytes": 0, "log": "runs/lab05/servers/epoch-files/requests.jsonl"},
                         "shards": {"layout": "shards", "opens": 7, "bytes": 819200, "requests": 207, "seconds": 0.15,
                                    "wrong_bytes": 0, "log": "runs/lab05/servers/epoch-shards/requests.jsonl"}})
epochs = [{"epoch": e, "counts": [67, 67, 66], "overlap": 0, "covered": 200, "repeats": 0} for e in (0, 1)]
record("sampler_run", {"log": "runs/lab05/servers/sampler/requests.jsonl", "layout": "shards", "world": 3, "epochs": 2,
                       "code": {"my_sampler.py": "0" * 64}, "index": "runs/lab05/data/shards/index.json",
                       "verdict": {"epochs": epochs, "disjoint": True, "complete": True, "balanced": True,
                                   "reshuffled": True, "misplaced": 0}})
jobs = [{"job": "train-a", "user": "alice", "ranks": 1, "chunk": 32768},
        {"job": "train-b", "user": "bob", "ranks": 2, "chunk": 32768},
        {"job": "bulk-c", "user": "bob", "ranks": 1, "chunk": 131072}]
def row(policy, shares):
    return {"policy": policy, "log": f"runs/lab05/servers/policy-{policy.replace(':', '-')}/requests.jsonl",
            "jobs": {j: {"share": s, "target": None, "error_vs_target": None, "error_vs_job_fair": abs(3 * s - 1),
                         "slowdown": 1 / s / 3} for j, s in zip(("train-a", "train-b", "bulk-c"), shares)},
            "worst_error_vs_job_fair": max(abs(3 * s - 1) for s in shares), "code": {}, "policy_errors": []}
record("fair_share", {"jobs": jobs, "rows": [row("fifo", (0.14, 0.29, 0.57)), row("job-fair", (1 / 3,) * 3),
                                             row("my_policy:pick", (1 / 3,) * 3)]})
losses = [1.4 - 0.01 * i for i in range(5)]
engine = []
for name, step_s, data, wait in (("engine-alone", 0.06, 0.6, 0.3), ("engine-beside-bulk-c", 0.9, 0.95, 25.0)):
    run_dir = f"runs/lab05/data/runs/{name}"
    engine.append({"name": name, "run_dir": run_dir, "log": f"runs/lab05/servers/{name}/requests.jsonl",
                   "samples_per_s": 32 / step_s, "data_fraction": data, "final_loss": losses[-1], "ranks": [0, 1],
                   "requests": 326, "bytes": 330000, "mean_wait_ms": wait, "other_bytes": 0 if wait < 1 else 1e8})
    if EVENTS:
        fake_run(run_dir, world=2, losses=losses, batch=32, step_s=step_s, data_fraction=data)
record("engine_runs", engine)
record("spread", {"rows": [{"run": run, "epoch": e, "local_reads": 0 if run == "shared" else 134,
                            "remote_reads": 0 if run == "shared" else 122, "shared_reads": 256 if run == "shared" else 0,
                            "seconds": 0.1, "remote_pairs": {}, "path": ["default"] if run == "shared"
                            else ["my_reader:read_sample"]} for run in ("shared", "spread") for e in (0, 1)],
                  "staged": {}, "run_dirs": {"shared": "runs/lab05/runs/ex-shared", "spread": "runs/lab05/runs/ex-spread"}})
record("cache", {"rows": [], "cut": {"none": 0.0, "private": 0.26, "node": 1.0}, "target": 0.75,
                 "run_dirs": {"cache-node": "runs/lab05/runs/ex-cache-node"}})
record("balance", {"rows": [{"read_threads": r, "decode_threads": 4 - r, "samples_per_s": 150.0,
                             "model_samples_per_s": 800.0} for r in (1, 2, 3)], "best": [2, 2], "predicted": [2, 2]})
'''

NOT_WRITTEN = {"06_checkpointing": {"kill_leaves_no_partial_checkpoint", "restore_loads_only_intact_checkpoints",
                                     "resumed_after_the_kill_equals_the_whole_run"},
               "05_data_pipeline": {"per_reader_bandwidth_falls_as_one_over_n", "shards_cut_the_opens",
                                    "sampler_is_disjoint_complete_and_reshuffled", "policy_holds_job_fair_shares",
                                    "fifo_is_not_fair", "recorded_shares_are_the_logs",
                                    "engine_runs_read_through_the_server", "contention_slows_the_training_run",
                                    "read_path_uses_the_nodes_not_the_shared_fs",
                                    "node_cache_cuts_shared_reads_by_n_minus_1_over_n"}}
"""Hidden checks that judge files other than event files, which these forgeries do not write (lab 06's kill test:
its processes' logs and the folders they left; lab 05's storage servers' request logs and the spread runs' read
events): they fail the forgery for want of those files. Those files have no
clock to hold them to; a forger who wrote them consistently would pass them (docs/grading.md, "Forged records")."""

FORGERIES = {"01_single_device": LAB01, "02_data_parallel": LAB02, "03_horovod": LAB03, "04_scaling": LAB04,
             "05_data_pipeline": LAB05, "06_checkpointing": LAB06}


def forged_notebook(lab: Path, with_events: bool) -> dict:
    """The reference notebook with every code cell but the parameters cell replaced by one forging cell."""
    nb = json.loads((lab / "lab.ipynb").read_text())
    cells = [c for c in nb["cells"] if c["cell_type"] != "code" or "parameters" in c["metadata"].get("tags", [])]
    source = ("from scalelab.record import record\n" + FAKE_EVENTS + f"\nEVENTS = {with_events}\n"
              + FORGERIES[lab.name])
    cells.append({"cell_type": "code", "execution_count": None, "id": "forged", "metadata": {}, "outputs": [],
                  "source": source})
    return {**nb, "cells": cells}


def forged_records(lab: Path) -> dict:
    """What the forging cell records, computed here (no kernel, no events)."""
    records: dict = {}
    exec(compile(FAKE_EVENTS + "\nEVENTS = False\n" + FORGERIES[lab.name], "forgery", "exec"),
         {"record": lambda name, value: records.__setitem__(name, json.loads(json.dumps(value)))})
    return records


# A classmate's runs, copied: their event files re-stamped so each run ends now (after waiting as long as the longest
# run took, so every event lies inside this grading), their spec and code beside them, and the classmate's records.
# With NONCE the start events also carry this grading's nonce, read from the kernel's environment, as a student who
# read the grader's docs would do: only a re-run can tell these files from this notebook's own.
COPY_RUNS = '''
import base64, json, os, time, zlib
from pathlib import Path
from scalelab.record import record

def unpack(blob):
    return json.loads(zlib.decompress(base64.b64decode(blob)))

# the classmate's absolute paths become this working copy's, as they would be had the runs been made here
records = json.loads(json.dumps(unpack(RECORDS)).replace(THEIRS, json.dumps(os.getcwd())[1:-1]))
runs = unpack(RUNS)
def times(files):  # events of other shapes (lab 05's read logs under events/) carry no time: copied as they are
    return [e["t"] for lines in files["events"].values() for e in lines if isinstance(e.get("t"), (int, float))] or [0]
time.sleep(max(max(times(f)) - min(times(f)) for f in runs.values()) + 2)
mine = os.environ.get("SCALELAB_GRADE_NONCE")
for run_dir, files in runs.items():
    shift = time.time() - 0.5 - max(times(files))
    folder = Path(run_dir)
    (folder / "events").mkdir(parents=True, exist_ok=True)
    for name, text in files["other"].items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)
    for name, events in files["events"].items():
        with open(folder / "events" / name, "w") as f:
            for e in events:
                if isinstance(e.get("t"), (int, float)):
                    e = {**e, "t": e["t"] + shift}
                if NONCE and e.get("type") == "start":
                    e["nonce"] = mine
                f.write(json.dumps(e) + "\\n")
for name, value in records.items():
    record(name, value)
'''


def copied_notebook(lab: Path, records: dict, work: Path, nonce: bool) -> dict:
    """The reference notebook with every code cell but the parameters cell replaced by one that hands in a classmate's
    graded work: `records` (what the classmate's checks ran on) and the run folders of `work` (the classmate's kept
    working copy) that the grader found there — their event files, spec.json and code of the student's own."""
    import base64
    import zlib

    def pack(value) -> str:
        return base64.b64encode(zlib.compress(json.dumps(value).encode())).decode()

    runs = {}
    for key in records.get("grader.runs", {}):
        folder = work / key
        events = {f.name: [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
                  for f in sorted((folder / "events").glob("rank-*.jsonl"))}
        other = {str(f.relative_to(folder)): f.read_text() for f in [folder / "spec.json", *folder.glob("code/*.py")]
                 if f.is_file()}
        if events:
            runs[key] = {"events": events, "other": other}
    mine = {k: v for k, v in records.items() if not k.startswith("grader.")}
    nb = json.loads((lab / "lab.ipynb").read_text())
    cells = [c for c in nb["cells"] if c["cell_type"] != "code" or "parameters" in c["metadata"].get("tags", [])]
    theirs = json.dumps(str(records.get("grader.workdir", work)))[1:-1]
    source = f"RECORDS = {pack(mine)!r}\nRUNS = {pack(runs)!r}\nNONCE = {nonce}\nTHEIRS = {theirs!r}\n" + COPY_RUNS
    cells.append({"cell_type": "code", "execution_count": None, "id": "copied", "metadata": {}, "outputs": [],
                  "source": source})
    return {**nb, "cells": cells}


__all__ = ["FAKE_EVENTS", "FORGERIES", "forged_notebook", "forged_records", "copied_notebook"]
