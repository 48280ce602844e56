"""Byte-level text for the language model (`data.source = pysrc`): the Python standard library's own source files.

Every machine that runs Python has this corpus, so nothing is downloaded (a cluster node without internet access,
a CI runner, a laptop on a train). The corpus is this interpreter's `sysconfig.get_paths()["stdlib"]` *.py files,
sorted by their path below it, without the folders distributions ship differently (site-packages, dist-packages,
test suites, idlelib): CPython 3.11.2 on Debian 12 gives 638 files, 11.0 MB (9.9 MB to train on, 1.0 MB
held out). Another Python version has another corpus;
`corpus_facts()` says which one a run used.

Split: every HELD_OUT_EVERY-th file in that order is held out (about a tenth of the bytes, whole files, so no
held-out text was seen in training); the rest, concatenated, is the training text.

Tokens are bytes (a vocabulary of 256, no tokenizer to ship). A sample is `seq_len` consecutive bytes and, as its
target, the `seq_len` bytes one position later (next-byte prediction at every position). Training samples start at
seeded random offsets of the training text (the same on every rank: same seed); the held-out samples are evenly
spaced windows of the held-out text, the same for every run of one seq_len.

The ids travel as float32 (exact for 0..255): every stage of a pipeline then receives a float tensor, the type the
pipeline's first stage asks a gradient of and the mesh probes a stage's activation shape with (train/mesh.py). The
model turns them back into integer ids (train/gpt.py). Targets are int64, as cross-entropy wants them.
"""
from __future__ import annotations

import functools
import math
import sysconfig
from pathlib import Path

import torch

VOCAB = 256
"""Byte-level tokens."""
HELD_OUT_EVERY = 10
"""Every 10th file (sorted order) is held out."""
SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__"})
"""Folders left out of the corpus: installed packages and the parts distributions strip or keep differently."""
EVAL_WINDOWS = (32, 256)
"""Held-out samples: samples // 8, at least 32 and at most 256."""


def stdlib_root() -> Path:
    """Where this interpreter's standard library lives."""
    return Path(sysconfig.get_paths()["stdlib"])


def source_files(root: str | Path | None = None) -> list[Path]:
    """The corpus's files: *.py under `root` (default: the stdlib) outside SKIP_DIRS, sorted by relative path."""
    root = Path(root) if root else stdlib_root()
    files = [p for p in root.rglob("*.py") if not SKIP_DIRS & set(p.relative_to(root).parts[:-1])]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


@functools.lru_cache(maxsize=2)
def corpus(root: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(training bytes, held-out bytes) as uint8 tensors; every HELD_OUT_EVERY-th file is held out."""
    train, held = bytearray(), bytearray()
    for i, path in enumerate(source_files(root)):
        (held if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1 else train).extend(path.read_bytes())
    if len(held) < 2 or len(train) < 2:
        raise ValueError(f"the Python sources under {root or stdlib_root()} are too few to train on "
                         f"({len(train)} training and {len(held)} held-out bytes)")
    return torch.frombuffer(train, dtype=torch.uint8), torch.frombuffer(held, dtype=torch.uint8)


def corpus_facts(root: str | None = None) -> dict:
    """Which corpus this machine has: its folder, file count, training and held-out bytes."""
    train, held = corpus(root)
    return {"root": str(Path(root) if root else stdlib_root()), "files": len(source_files(root)),
            "train_bytes": len(train), "held_out_bytes": len(held)}


def _windows(text: torch.Tensor, starts: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x (n, seq_len) float32 ids and y (n, seq_len) int64 next-byte targets for windows starting at `starts`."""
    index = starts[:, None] + torch.arange(seq_len + 1)[None, :]
    chunk = text[index].long()
    return chunk[:, :-1].float(), chunk[:, 1:].contiguous()


def train_samples(samples: int, seq_len: int, seed: int, root: str | None = None):
    """`samples` training windows at offsets drawn from `seed`."""
    train, _ = corpus(root)
    if len(train) <= seq_len + 1:
        raise ValueError(f"data.seq_len={seq_len} is longer than the training text ({len(train)} bytes)")
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(train) - seq_len - 1, (samples,), generator=g)
    return _windows(train, starts, seq_len)


def eval_count(samples: int) -> int:
    """How many held-out windows a run of `samples` training windows is scored on."""
    low, high = EVAL_WINDOWS
    return min(high, max(low, samples // 8))


def held_out_samples(count: int, seq_len: int, root: str | None = None):
    """`count` evenly spaced windows of the held-out text (the same for every seed)."""
    _, held = corpus(root)
    if len(held) <= seq_len + 1:
        raise ValueError(f"data.seq_len={seq_len} is longer than the held-out text ({len(held)} bytes)")
    starts = torch.linspace(0, len(held) - seq_len - 1, count).long()
    return _windows(held, starts, seq_len)


def unigram_loss(targets: torch.Tensor, root: str | None = None) -> float:
    """The baseline a language model must beat: the cross-entropy (nats per byte) of `targets` under the training
    text's byte frequencies (add-one smoothed), i.e. a model that knows how often each byte occurs and no context."""
    train, _ = corpus(root)
    counts = torch.bincount(train.long(), minlength=VOCAB).double() + 1
    log_p = (counts / counts.sum()).log()
    return float(-log_p[targets.reshape(-1).long()].mean())


def entropy_bits(loss_nats: float) -> float:
    """A loss in nats per byte as bits per byte."""
    return loss_nats / math.log(2)


__all__ = ["VOCAB", "HELD_OUT_EVERY", "stdlib_root", "source_files", "corpus", "corpus_facts", "train_samples",
           "eval_count", "held_out_samples", "unigram_loss", "entropy_bits"]
