"""GPU use per student for the class dashboard (issue 36, item 4): the GPUs each student's server job holds, their
utilisation and memory, and an idle flag (a GPU held at 0 % for longer than `dashboard.gpu_idle_after_s`).

Where the numbers come from, and when there are none:

- **Slurm** (a centre): `sstat -a -P -o JobID,TRESUsageInAve -j <jobs>`: Slurm's jobacct_gather records
  `gres/gpuutil` (percent) and `gres/gpumem` (bytes) per step when the gpu/nvml plugin runs on the nodes
  (gres.conf `AutoDetect=nvml`; `AccountingStorageTRES=gres/gpu` also sets gres/gpumem and gres/gpuutil). The job's
  steps are summed (a server's kernel runs in the batch step; an `srun` from the notebook is a step of its own).
- **A stand-in GPU** (the local clusters on a machine without GPUs: Gres counted by Slurm with no NVIDIA device
  behind it, gres.conf `Count=` or a `File=` outside /dev): nothing can measure it. The row shows 0 % and 0 bytes
  with "stand-in GPU, not measured", and such a GPU is never flagged idle (0 is not a measurement).
- **A real GPU Slurm does not measure** (jobacct_gather/none, as on the 1-node local cluster on a GPU machine, or
  a site without the nvml plugin): no number at all, and the row says why. Never a made-up number.

gres.conf is read where Slurm reads it: beside slurm.conf (`slurm.conf` from the hub's SLURM_CONF). Only staff see
any of it: the dashboard's role gate (`scalelab.hub.dashboard`) shows TAs the course's students only, and students
nothing.
"""
from __future__ import annotations

import os
import re
import subprocess
import threading
import time
from pathlib import Path
from typing import Callable, Mapping

from .queue import expand_hostlist

STAND_IN = "stand-in GPU, not measured"
NOT_RECORDED = ("not measured: Slurm records no GPU use here (it needs jobacct_gather and the gpu/nvml plugin, "
                "gres.conf AutoDetect=nvml)")
_TRES = re.compile(r"(?:^|,)gres/gpu(?::[^=,]*)?=(\d+)")


def held_gpus(scontrol_jobs: str) -> dict[str, dict]:
    """{job id: {"gpus": N, "nodes": "node1"}} from `scontrol show job -o -d` (all jobs), for jobs holding GPUs:
    the allocated TRES (gres/gpu=N: where accounting tracks it; a typed count is counted once with its untyped
    twin), else the allocated GRES (JOB_GRES=gpu:N, which -d prints whether or not accounting tracks GPUs)."""
    out = {}
    for line in scontrol_jobs.splitlines():
        fields = dict(re.findall(r"(\w+)=(\S*)", line))
        job = fields.get("JobId")
        tres = fields.get("TRES") or fields.get("AllocTRES") or ""
        counts = [int(m.group(1)) for m in _TRES.finditer(tres)]
        untyped = re.search(r"(?:^|,)gres/gpu=(\d+)", tres)
        gpus = int(untyped.group(1)) if untyped else sum(counts)
        if not gpus:
            gpus = sum(int(m.group(1)) for m in re.finditer(r"(?:^|,)gpu(?::[^:,(]+)?:(\d+)",
                                                            fields.get("JOB_GRES", "")))
        if job and gpus:
            out[job] = {"gpus": gpus, "nodes": fields.get("NodeList", "")}
    return out


def stand_in_nodes(gres_conf: str) -> set[str]:
    """Nodes whose GPUs in gres.conf have no NVIDIA device behind them (Count= only, or File= outside /dev)."""
    out = set()
    for line in gres_conf.splitlines():
        fields = dict(re.findall(r"(\w+)=(\S+)", line.split("#", 1)[0]))
        if fields.get("Name") != "gpu" or "AutoDetect" in fields:
            continue
        files = fields.get("File", "")
        if not files or not all(f.startswith("/dev/") for f in files.split(",")):
            out.update(expand_hostlist(fields.get("NodeName", "")))
    return out


def parse_sstat(text: str) -> dict[str, dict]:
    """{job id: {"util": percent, "mem_bytes": bytes}} from `sstat -n -P -a -o JobID,TRESUsageInAve`, the job's
    steps summed; a job whose steps carry no gres/gpuutil is left out (not recorded, not zero)."""
    out: dict[str, dict] = {}
    for line in text.splitlines():
        step, _, tres = line.partition("|")
        values = dict(item.split("=", 1) for item in tres.split(",") if "=" in item)
        if "gres/gpuutil" not in values:
            continue
        job = step.split(".")[0].split("_")[0]
        got = out.setdefault(job, {"util": 0.0, "mem_bytes": 0})
        got["util"] += _number(values["gres/gpuutil"])
        got["mem_bytes"] += int(_number(values.get("gres/gpumem", "0")))
    return out


_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def _number(text: str) -> float:
    m = re.fullmatch(r"([0-9.]+)([KMGT]?)%?", text.strip())
    return float(m.group(1)) * _UNITS[m.group(2)] if m else 0.0


class IdleTracker:
    """When each job's measured utilisation was last above 0 (or first seen at 0): a job is idle once it has been at
    0 for longer than the setting. Samples come from each dashboard read and from the service's background reading
    (`start_sampler`, every SAMPLE_EVERY_S); between two readings at 0 the GPU is taken to have stayed at 0."""

    def __init__(self):
        self.zero_since: dict[str, float] = {}

    def observe(self, job: str, util: float, now: float) -> float | None:
        """Record a sample; the time it has been at 0 since, or None when it is busy."""
        if util > 0:
            self.zero_since.pop(job, None)
            return None
        return self.zero_since.setdefault(job, now)

    def forget_others(self, jobs) -> None:
        """Drop jobs that are no longer running."""
        for job in set(self.zero_since) - set(jobs):
            del self.zero_since[job]


TRACKER = IdleTracker()


def _slurm(cfg: Mapping, *argv: str) -> str:
    env = {**os.environ, **({"SLURM_CONF": cfg["slurm"]["conf"]} if cfg["slurm"].get("conf") else {})}
    tool = os.path.join(cfg["slurm"]["bin_dir"], argv[0])
    try:
        r = subprocess.run([tool if os.path.exists(tool) else argv[0], *argv[1:]], capture_output=True, text=True,
                           env=env, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return ""
    return r.stdout if r.returncode == 0 else ""


def gres_conf_text(cfg: Mapping) -> str:
    """The cluster's gres.conf (beside slurm.conf, where Slurm reads it), or "" when there is none to read."""
    conf = cfg["slurm"].get("conf") or os.environ.get("SLURM_CONF") or "/etc/slurm/slurm.conf"
    try:
        return (Path(conf).parent / "gres.conf").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""


def gpu_rows(cfg: Mapping, jobs: Mapping[str, Mapping], now: float | None = None,
             tracker: IdleTracker = TRACKER) -> dict[str, dict]:
    """{student: {"gpus", "nodes", "util", "mem_bytes", "measured", "note", "idle", "idle_s"}} for the students whose
    running server job (`jobs`: dashboard.slurm_jobs) holds GPUs."""
    running = {name: j["job"] for name, j in jobs.items() if j.get("state") == "running"}
    if not running:
        tracker.forget_others(())
        return {}
    held = held_gpus(_slurm(cfg, "scontrol", "show", "job", "-o", "-d"))
    mine = {name: job for name, job in running.items() if job in held}
    if not mine:
        tracker.forget_others(())
        return {}
    stand_ins = stand_in_nodes(gres_conf_text(cfg))
    measured = parse_sstat(_slurm(cfg, "sstat", "-n", "-P", "-a", "-o", "JobID,TRESUsageInAve", "-j",
                                  ",".join(mine.values())))
    now = time.time() if now is None else now
    after = float(cfg["dashboard"].get("gpu_idle_after_s", 1800))
    rows = {}
    for name, job in mine.items():
        nodes = held[job]["nodes"]
        row = {"gpus": held[job]["gpus"], "nodes": nodes, "util": None, "mem_bytes": None, "measured": False,
               "note": NOT_RECORDED, "idle": False, "idle_s": 0.0}
        if job in measured:
            row.update(util=round(measured[job]["util"], 1), mem_bytes=measured[job]["mem_bytes"], measured=True,
                       note="")
            since = tracker.observe(job, measured[job]["util"], now)
            row["idle_s"] = round(now - since, 1) if since is not None else 0.0
            row["idle"] = since is not None and now - since > after
        elif set(expand_hostlist(nodes)) <= stand_ins:
            row.update(util=0.0, mem_bytes=0, note=STAND_IN)
        rows[name] = row
    tracker.forget_others([mine[n] for n in rows if rows[n]["measured"]])
    return rows


SAMPLE_EVERY_S = 60.0
"""How often the dashboard service reads the GPUs in the background (slurm mode), page loads or not: the idle flag
then rests on a reading at least this often (one squeue, one scontrol and one sstat for the whole class)."""


def start_sampler(cfg: Mapping, jobs: Callable[[], Mapping[str, Mapping]], every: float = SAMPLE_EVERY_S,
                  tracker: IdleTracker = TRACKER) -> threading.Event:
    """A daemon thread feeding `tracker` from `gpu_rows` every `every` seconds, until the returned event is set;
    `jobs` gives the servers' jobs (dashboard.slurm_jobs). A failed reading is skipped, never fatal."""
    stop = threading.Event()

    def loop():
        while not stop.wait(every):
            try:
                gpu_rows(cfg, jobs(), tracker=tracker)
            except Exception:  # noqa: BLE001 - a reading that fails is taken again next time
                pass
    threading.Thread(target=loop, name="gpu-sampler", daemon=True).start()
    return stop


def describe(row: Mapping | None) -> str:
    """The dashboard cell: 'none', or GPUs, utilisation and memory, the idle flag, or why there is no number."""
    if not row:
        return "none"
    head = f"{row['gpus']} GPU{'s' if row['gpus'] != 1 else ''}"
    if row["util"] is None:
        return f"{head}: {row['note']}"
    text = f"{head}: {row['util']:g} %, {row['mem_bytes'] / 2**30:.1f} GiB"
    if row["note"]:
        text += f" ({row['note']})"
    if row["idle"]:
        text += f" · IDLE for {row['idle_s'] / 60:.0f} min"
    return text
