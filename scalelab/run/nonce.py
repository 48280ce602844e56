"""The grader's per-submission nonce, as a run sees it: what makes a run's numbers belong to one grading.

When `scalelab grade` runs a submission it puts a fresh random nonce in the environment (NONCE_VAR) of the notebook's
kernel, which every run launched from it inherits. The training loop mixes it into the seed of the model's
initial weights and of the data order (`init_seed`) and writes it in every start event (`nonce()`), so

- a run copied from a classmate (or from the student's own earlier grading) carries another nonce, and
- events written by hand cannot carry the losses a run with this nonce has: the grader re-runs a sample of the
  runs for a few steps with the same nonce and compares (scalelab/grade/reverify.py; REVERIFY_VAR tells the loop
  to stop after that many steps).

Outside a grading neither variable is set: the seed is the spec's own, and the start event's nonce is None. Runs
that share a spec seed still share their initial weights under a nonce (the mix is a function of both), so labs
that compare two runs of one seed compare like with like.
"""
from __future__ import annotations

import hashlib
import os
import re

NONCE_VAR = "SCALELAB_GRADE_NONCE"
REVERIFY_VAR = "SCALELAB_REVERIFY_STEPS"
_NONCE = re.compile(r"[0-9a-f]{8,64}")


def nonce() -> str | None:
    """This process's grading nonce (hex), or None outside a grading (or when the variable holds something else)."""
    value = os.environ.get(NONCE_VAR, "")
    return value if _NONCE.fullmatch(value) else None


def init_seed(seed: int) -> int:
    """The seed of initial weights and data order: `seed` itself outside a grading, else a mix of it and the nonce
    (below 2**31, which every RNG here accepts)."""
    return mix_seed(seed, nonce())


def mix_seed(seed: int, grading_nonce: str | None) -> int:
    """`seed` mixed with a grading's nonce (`seed` itself for None): what `init_seed` gives inside that grading,
    and what a hidden check recomputes from the grading's nonce."""
    if grading_nonce is None:
        return seed
    digest = hashlib.sha256(f"{grading_nonce}:{int(seed)}".encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFF_FFFF


def reverify_steps() -> int | None:
    """How many steps a grader's re-run trains before it stops (None: a normal run, all of them)."""
    value = os.environ.get(REVERIFY_VAR, "")
    return int(value) if value.isdigit() and int(value) > 0 else None


__all__ = ["NONCE_VAR", "REVERIFY_VAR", "nonce", "init_seed", "mix_seed", "reverify_steps"]
