"""What a rank does with host memory it frees: keep it for the next step, or hand it back to the OS.

A training step allocates and frees the same large buffers every step. glibc's malloc serves a block
above its mmap threshold (which adapts upwards, but never past 32 MiB) with a fresh mmap and unmaps it at
free, and it trims the top of its heap: the next step faults every page in again and the kernel zeroes it.
The course's CNN on 32x32 fields at batch 128 (one rank, 100 steps, 2-core VM) took 950,000 page faults and
2.2 s of kernel time that way, and ran at 815 samples/s; with `retain` it took 113,000 faults, 0.5 s, and
ran at 910-960 samples/s. With two ranks on two cores, one rank's page faulting also holds up the other at
every allreduce. `retain` raises both thresholds with mallopt, so freed blocks stay in the process: the
zero-dependency form of the jemalloc/tcmalloc advice in PyTorch's CPU performance guide. The price is that
a rank's resident memory stays at its peak, as with a GPU caching allocator.

Without glibc's mallopt (macOS, musl) there is nothing to set; the start event says so.
"""
from __future__ import annotations

import ctypes

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
RETAIN_BYTES = 1 << 30
"""Blocks up to 1 GiB come from the heap and stay there when freed."""
GLIBC_MMAP_MAX = 32 << 20
"""The largest mmap threshold older glibc versions accept on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX)."""
TRIM_BYTES = (1 << 31) - 1
"""Trim the heap top only above 2 GiB free (mallopt takes a C int)."""


def _mallopt():
    try:
        fn = ctypes.CDLL(None).mallopt
    except (AttributeError, OSError):
        return None
    fn.argtypes, fn.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return fn


def apply_malloc_policy(policy: str, mallopt=None) -> str:
    """Apply `policy` (retain or system) to this process; returns what is in force, for the start event."""
    if policy == "system":
        return "system"
    mallopt = mallopt or _mallopt()
    if mallopt is None:
        return "system (this C library has no mallopt)"
    for threshold in (RETAIN_BYTES, GLIBC_MMAP_MAX):
        if mallopt(M_MMAP_THRESHOLD, threshold) and mallopt(M_TRIM_THRESHOLD, TRIM_BYTES):
            return f"retain (blocks up to {threshold >> 20} MiB)"
    return "system (mallopt refused the thresholds)"
