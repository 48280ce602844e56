"""The experiments of Lab 06, as functions a notebook cell calls and a test can call too (with what the lab reads
of the engine's checkpoints: `read_manifest`, retention's `select`; and the kill test of the student's own save and
restore, `kill_and_resume`, from `kill_resume`)."""
from __future__ import annotations

import shutil
from pathlib import Path

import torch

from ..errors import ScalelabError
from ..ckpt.manifest import read_manifest
from ..ckpt.retention import select
from ..ckpt.sync import latest_checkpoint, load_checkpoint, save_checkpoint
from .ckpt_timeline import timeline
from .kill_resume import kill_and_resume


def anatomy(directory, width: int = 64) -> dict:
    """Save two checkpoints of a small model, then show what protects them: a stray partial file is never
    loaded, and a corrupted copy is refused with the file named. Returns what a lab records."""
    directory = Path(directory)
    shutil.rmtree(directory, ignore_errors=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.ReLU(), torch.nn.Linear(width, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in (1, 2):
        model(torch.randn(8, 16)).sum().backward()
        opt.step()
        save_checkpoint(directory, step, model, opt, keep_last=2)
    partial = directory / ".step-00000003.pt.killed.tmp"  # what a process killed mid-write leaves behind
    partial.write_bytes(b"PK\x03\x04 half a checkpoint")
    out = {"files": sorted(p.name for p in directory.iterdir()), "manifest": read_manifest(directory),
           "latest": latest_checkpoint(directory).name, "partial_error": _error_of(load_checkpoint, partial, model)}
    corrupt_dir = directory.parent / f"{directory.name}-corrupted"
    shutil.rmtree(corrupt_dir, ignore_errors=True)
    shutil.copytree(directory, corrupt_dir)
    victim = corrupt_dir / out["latest"]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01  # one flipped bit
    victim.write_bytes(bytes(data))
    out["corrupt_error"] = _error_of(load_checkpoint, victim, model)
    out["corrupt_file"] = str(victim)
    return out


def _error_of(fn, *args) -> str | None:
    try:
        fn(*args)
    except ScalelabError as e:
        return str(e)
    return None


def mode_summary(events) -> dict:
    """What Lab 06 compares between checkpoint modes, from rank 0's events of one run."""
    tl = timeline(events)
    blocks = [b - a for a, b, _ in tl["blocks"]]
    return {"mode": tl["mode"], "checkpoints": tl["checkpoints"], "blocked_s": tl["blocked_s"],
            "blocked_fraction": tl["blocked_fraction"], "flush_s": tl["flush_s"], "train_s": tl["train_s"],
            "max_block_s": max(blocks, default=0.0)}


def final_params(run_dir) -> dict:
    """The model a run saved at its end (rank 0's model.pt)."""
    return torch.load(Path(run_dir) / "model.pt", weights_only=True)


__all__ = ["anatomy", "mode_summary", "final_params", "read_manifest", "select", "timeline", "kill_and_resume"]
