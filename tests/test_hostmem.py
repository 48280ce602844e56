"""world.malloc: a rank keeps the host memory it frees (retain) or hands it back to the OS (system)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from scalelab.launch import launch
from scalelab.train.hostmem import (GLIBC_MMAP_MAX, M_MMAP_THRESHOLD, M_TRIM_THRESHOLD, RETAIN_BYTES,
                                    apply_malloc_policy)

from helpers import tiny


class FakeMallopt:
    """Records mallopt calls; refuses mmap thresholds above `limit` as some glibc versions do."""

    def __init__(self, limit=None):
        self.calls, self.limit = [], limit

    def __call__(self, param, value):
        self.calls.append((param, value))
        return int(not (param == M_MMAP_THRESHOLD and self.limit is not None and value > self.limit))


def test_retain_raises_the_mmap_and_trim_thresholds():
    fake = FakeMallopt()
    assert apply_malloc_policy("retain", fake) == "retain (blocks up to 1024 MiB)"
    params = dict(fake.calls)
    assert params[M_MMAP_THRESHOLD] == RETAIN_BYTES and params[M_TRIM_THRESHOLD] >= RETAIN_BYTES


def test_retain_falls_back_to_the_largest_threshold_an_older_glibc_accepts():
    fake = FakeMallopt(limit=GLIBC_MMAP_MAX)
    assert apply_malloc_policy("retain", fake) == "retain (blocks up to 32 MiB)"
    assert (M_MMAP_THRESHOLD, GLIBC_MMAP_MAX) in fake.calls


def test_a_refused_policy_and_a_missing_mallopt_are_reported_not_raised(monkeypatch):
    assert apply_malloc_policy("retain", FakeMallopt(limit=0)) == "system (mallopt refused the thresholds)"
    monkeypatch.setattr("scalelab.train.hostmem._mallopt", lambda: None)
    assert apply_malloc_policy("retain") == "system (this C library has no mallopt)"


def test_system_leaves_malloc_alone():
    fake = FakeMallopt()
    assert apply_malloc_policy("system", fake) == "system" and fake.calls == []


_FAULTS = """
import json, resource, sys, torch
from scalelab.train.hostmem import apply_malloc_policy
applied = apply_malloc_policy(sys.argv[1])
def step():  # a step keeps a 64 MB workspace (a convolution's unfolded input) and 16 MB activations, then frees all
    kept = [torch.ones(16 << 20)] + [torch.ones(4 << 20) for _ in range(4)]
    return sum(float(t[-1]) for t in kept)
for _ in range(4):
    step()  # warm up: the first steps fault their memory in under either policy
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    step()
print(json.dumps({"applied": applied, "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}))
"""


def _page_faults(policy: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _FAULTS, policy], capture_output=True, text=True, timeout=120,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt and page-fault counts: Linux")
def test_retain_stops_a_step_s_freed_activations_from_being_faulted_in_again_next_step():
    system, retain = _page_faults("system"), _page_faults("retain")
    assert retain["applied"].startswith("retain"), retain
    # system: a block above glibc's 32 MiB mmap ceiling is unmapped at free, so each of the 10 steps faults at least
    # its 64 MB in again (16,384 pages; fewer with transparent huge pages); retain: the memory stays in the process
    assert system["faults"] > 10 * 200, system
    assert retain["faults"] < system["faults"] / 10, (system, retain)


@pytest.mark.parametrize("policy, reported", [("retain", "retain"), ("system", "system")])
def test_the_start_event_says_which_policy_the_rank_runs_under(policy, reported, tmp_path):
    run = launch(tiny(tmp_path, workers=1, steps=2, **{"world.malloc": policy}))
    run.wait(timeout=120)
    start = next(e for e in run.events() if e["type"] == "start")
    assert start["malloc"].startswith(reported), start["malloc"]
