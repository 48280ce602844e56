"""A run's checkpoints on its own clock: when training stepped, when a save blocked it, when the bytes landed.

`timeline(events)` turns one rank's events (step, checkpoint, checkpoint_done) into intervals in seconds since
the rank's start, plus the totals Lab 06 compares between sync, async and sharded saves. The CheckpointTimeline
widget draws exactly this.
"""
from __future__ import annotations


def timeline(events, rank: int = 0) -> dict:
    """Intervals (start, end, step) of steps, save blocking and background flushes, and their totals."""
    mine = [e for e in events if e.get("rank") == rank]
    start = next((e["t"] for e in mine if e["type"] == "start"), min((e["t"] for e in mine), default=0.0))
    steps = [(e["t"] - e["step_s"] - start, e["t"] - start, e["step"]) for e in mine if e["type"] == "step"]
    blocks = [(e["t"] - e["blocked_s"] - start, e["t"] - start, e["step"]) for e in mine if e["type"] == "checkpoint"]
    done = [e for e in mine if e["type"] == "checkpoint_done"]
    flushes = [(e["finished_t"] - e["flush_s"] - start, e["finished_t"] - start, e["step"]) for e in done]
    blocked = sum(b - a for a, b, _ in blocks) + sum(e.get("update_wait_s", 0.0) for e in done)
    train = sum(b - a for a, b, _ in steps)
    return {"steps": steps, "blocks": blocks, "flushes": flushes, "checkpoints": len(blocks),
            "blocked_s": blocked, "flush_s": sum(b - a for a, b, _ in flushes), "train_s": train,
            "blocked_fraction": blocked / (train + sum(b - a for a, b, _ in blocks)) if steps else 0.0,
            "mode": next((e.get("mode") for e in mine if e["type"] == "checkpoint"), None)}


__all__ = ["timeline"]
