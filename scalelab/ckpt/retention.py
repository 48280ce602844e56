"""Which checkpoints to keep: the newest `keep_last`, plus the `keep_best` with the best metric.

A pure function over manifest entries, so the policy is tested without writing a byte. Entries without a
metric (or with a non-finite one) are never "best". The newest checkpoint is always kept, whatever the
settings: it is the one a restart resumes from.
"""
from __future__ import annotations

import math


def select(entries: list[dict], keep_last: int, keep_best: int = 0, lower_is_better: bool = True
           ) -> tuple[list[dict], list[dict]]:
    """(kept, dropped), both oldest first."""
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 (the newest checkpoint is what a restart needs), got {keep_last}")
    ordered = sorted(entries, key=lambda e: e["step"])
    keep = {e["step"] for e in ordered[-keep_last:]}
    scored = [e for e in ordered if isinstance(e.get("metric"), (int, float)) and math.isfinite(e["metric"])]
    scored.sort(key=lambda e: (e["metric"] if lower_is_better else -e["metric"], -e["step"]))
    keep |= {e["step"] for e in scored[:keep_best]}
    return [e for e in ordered if e["step"] in keep], [e for e in ordered if e["step"] not in keep]


def best(entries: list[dict], lower_is_better: bool = True) -> dict | None:
    """The entry with the best metric, or None when none has one."""
    scored = [e for e in entries if isinstance(e.get("metric"), (int, float)) and math.isfinite(e["metric"])]
    if not scored:
        return None
    return min(scored, key=lambda e: (e["metric"] if lower_is_better else -e["metric"], -e["step"]))


__all__ = ["select", "best"]
