"""Honest step timing, and a probe that tells an honest timer from one that is not.

A GPU runs a step's kernels after the Python call that queued them has returned, and the first steps pay for
allocation, autotuning and compilation. An honest timer of `steps` steps therefore runs `warmup` steps untimed,
waits for the device (`sync()`) before it starts the clock, and again before it stops it. Lab 01's students write
that timer as `time_steps(step, steps, warmup, sync) -> seconds per step`, and the lab's measurements use it.

On a CPU, `sync` does nothing and a timer without it looks right. `timer_probe` therefore runs a timer against
`ProbeDevice`, a stand-in for an asynchronous device that works on any laptop: `step()` only queues `work_ms` of
work and returns at once (the first `warmup` calls queue `warmup_ms` each, like a first step that compiles); a
thread works through the queue; `sync()` waits until it is empty. The probe writes every call and every piece of
work, with its times, into `probe.jsonl` in the probe's folder, with the SHA-256 of the timer's module.
`probe_verdict(log)` works out from that log alone what an honest timer of those calls measures, so the grader
re-reads the same file and reaches the same verdict:

    probe = timer_probe("my_timer:time_steps", "runs/lab01/timer-probe")
    probe["measured_ms"], probe["honest_ms"]     # ~10 and ~10 for an honest timer; ~0.01 without sync()
"""
from __future__ import annotations

import json
import math
import queue
import threading
import time
from pathlib import Path

from ..paths import json_lines
from .own_code import OwnCodeError, load_own, not_written

LOG = "probe.jsonl"
TOLERANCE = 0.25
"""How far (as a fraction) an honest timer's reading may stray from the work the probe's log shows it timed: the
clock reads and a thread's wake-up on a busy machine, against 200 ms of timed work."""


class ProbeDevice:
    """An asynchronous device made of a queue and a thread: `step()` queues work and returns, `sync()` waits."""

    def __init__(self, warmup: int, work_ms: float, warmup_ms: float, log: list):
        self.warmup, self.work_s, self.warmup_s, self.log = warmup, work_ms / 1e3, warmup_ms / 1e3, log
        self.t0, self.calls = time.perf_counter(), 0
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._work, name="probe-device", daemon=True)
        self._thread.start()

    def now(self) -> float:
        """Seconds since the probe started (one clock for the calls and the work)."""
        return time.perf_counter() - self.t0

    def step(self) -> None:
        """Queue one step's work (a warm-up step's for the first `warmup` calls) and return at once."""
        i, t0 = self.calls, self.now()
        self.calls += 1
        self._queue.put((i, self.warmup_s if i < self.warmup else self.work_s))
        self.log.append({"type": "call", "what": "step", "i": i, "t0": t0, "t1": self.now()})

    def sync(self) -> None:
        """Wait until every queued piece of work has run."""
        t0 = self.now()
        self._queue.join()
        self.log.append({"type": "call", "what": "sync", "t0": t0, "t1": self.now()})

    def close(self) -> None:
        """Let the work still queued finish, then stop the thread."""
        self._queue.put(None)
        self._thread.join(timeout=60)

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                self._queue.task_done()
                return
            i, seconds = item
            t0 = self.now()
            time.sleep(seconds)
            self.log.append({"type": "work", "i": i, "t0": t0, "t1": self.now()})
            self._queue.task_done()


def timer_probe(ref: str, out_dir, steps: int = 20, warmup: int = 3, work_ms: float = 10.0,
                warmup_ms: float = 100.0) -> dict:
    """Run the timer `ref` ("module:function", time_steps(step, steps, warmup, sync) -> seconds per step) on a
    ProbeDevice; writes out_dir/probe.jsonl and out_dir/code/<module>.py; returns `probe_verdict` of the log with
    run_dir. Raises NotImplementedError, naming the function, while the exercise is not written."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    timer, code = load_own(ref, out_dir)
    log = [{"type": "start", "timer": ref, "code": code, "steps": steps, "warmup": warmup, "work_ms": work_ms,
            "warmup_ms": warmup_ms}]
    device = ProbeDevice(warmup, work_ms, warmup_ms, log)
    try:
        seconds = timer(device.step, steps, warmup, device.sync)
    except NotImplementedError:
        raise not_written(ref) from None
    finally:
        device.close()
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not math.isfinite(seconds):
        raise OwnCodeError(f"{ref} returned {seconds!r}: it must return the seconds per step, a number")
    log.append({"type": "result", "seconds_per_step": float(seconds)})
    (out_dir / LOG).write_text("".join(json.dumps(e) + "\n" for e in log))
    return {"run_dir": str(out_dir), **probe_verdict(log)}


def probe_verdict(log: list[dict]) -> dict:
    """What the timer measured (measured_ms), what an honest timer of the same calls measures (honest_ms: the
    device's time for the last `steps` calls' work, from the start of the first to the end of the last, per step;
    the warm-up's work is not in it, and a clock started before that work is done counts it), what a timer that
    never waits for the device reads (launch_ms), the calls made, and `honest` (within TOLERANCE, the right number
    of calls)."""
    start = next(e for e in log if e.get("type") == "start")
    result = [e for e in log if e.get("type") == "result"][-1]
    steps, warmup = int(start["steps"]), int(start["warmup"])
    calls = [e for e in log if e.get("type") == "call" and e.get("what") == "step"]
    work = {e["i"]: e for e in log if e.get("type") == "work"}
    timed = [c for c in calls if c["i"] >= warmup]
    if len(calls) != steps + warmup or not timed or not all(c["i"] in work for c in timed):
        honest_s = launch_s = math.nan
    else:  # the device's time for the timed steps' work, from the first one's start to the last one's end
        honest_s = (work[timed[-1]["i"]]["t1"] - work[timed[0]["i"]]["t0"]) / steps
        launch_s = (timed[-1]["t1"] - timed[0]["t0"]) / steps
    measured_s = float(result["seconds_per_step"])
    ratio = measured_s / honest_s if honest_s > 0 else math.nan
    return {"timer": start["timer"], "code": start["code"], "steps": steps, "warmup": warmup,
            "calls": len(calls), "syncs": sum(1 for e in log if e.get("what") == "sync"),
            "work_ms": float(start["work_ms"]), "measured_ms": 1e3 * measured_s, "honest_ms": _ms(honest_s),
            "launch_ms": _ms(launch_s), "ratio": None if math.isnan(ratio) else ratio,
            "honest": bool(abs(ratio - 1) <= TOLERANCE)}


def _ms(seconds: float) -> float | None:
    """Milliseconds, or None where the log holds too few calls to say (JSON has no NaN)."""
    return None if math.isnan(seconds) else 1e3 * seconds


def read_log(text: str) -> list[dict]:
    """The events of a probe.jsonl text (lines that are not JSON objects are skipped)."""
    return json_lines(text)


__all__ = ["ProbeDevice", "timer_probe", "probe_verdict", "read_log", "LOG", "TOLERANCE"]
