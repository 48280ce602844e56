"""What this machine, or this process's share of it, has: usable CPUs, NVIDIA GPUs and memory, found in one place
(the engine's threads per rank, the local Slurm's node shape, the grader's sandbox devices and the site's "measured
on" line all read these)."""
from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity: a Slurm allocation, a cgroup, taskset), else all of them. The one
    count of CPUs the engine, its launchers and the labs share: os.cpu_count() is the machine's, which a job given 4
    of a node's 64 cores must not divide among its ranks."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return os.cpu_count() or 1


def gpu_device_files() -> tuple[str, ...]:
    """The /dev/nvidiaN files of this machine (a container may show only some of them), in numeric order."""
    found = [p for p in glob.glob("/dev/nvidia*") if re.fullmatch(r"/dev/nvidia\d+", p)]
    return tuple(sorted(found, key=lambda p: int(p[len("/dev/nvidia"):])))


def count_gpus() -> int:
    """Number of NVIDIA GPUs: the /dev/nvidiaN device files, else the GPUs that `nvidia-smi -L` lists."""
    files = gpu_device_files()
    if files:
        return len(files)
    smi = shutil.which("nvidia-smi")
    if not smi:
        return 0
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))  # MIG lines are indented


def memory_bytes() -> int:
    """Physical memory of this machine, in bytes."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


__all__ = ["count_gpus", "gpu_device_files", "memory_bytes", "usable_cpus"]
