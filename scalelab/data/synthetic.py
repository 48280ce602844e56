"""Seeded datasets that need no download.

`heat_fields` is a small scientific data set: 2-D temperature fields evolved by the heat equation
u_t = kappa * laplacian(u) (explicit finite differences, periodic boundary) from random blobs. The label
is the diffusivity class: a network must learn how smooth a field has become, which is learnable but not
trivial because every field is normalised to zero mean and unit variance and carries sensor noise.
"""
from __future__ import annotations

import numpy as np

from ..errors import SpecError

HEAT_STEPS = 12
KAPPA_RANGE = (0.02, 0.24)  # explicit scheme is stable for kappa <= 0.25 (dt = dx = 1)


def heat_fields(samples: int, size: int, classes: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """x (N,1,size,size) float32 normalised fields and y (N,) int64 diffusivity classes, from `seed`."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, classes, samples)
    centres = np.linspace(*KAPPA_RANGE, classes)
    half_gap = (centres[1] - centres[0]) / 2 if classes > 1 else 0.01
    kappa = centres[y] + rng.uniform(-0.4, 0.4, samples) * half_gap
    u = random_blobs(rng, samples, size)
    k = kappa[:, None, None].astype(np.float32)
    for _ in range(HEAT_STEPS):
        lap = (np.roll(u, 1, 1) + np.roll(u, -1, 1) + np.roll(u, 1, 2) + np.roll(u, -1, 2) - 4 * u)
        u = u + k * lap
    u = u + rng.normal(0, 0.02, u.shape).astype(np.float32)
    u = (u - u.mean(axis=(1, 2), keepdims=True)) / (u.std(axis=(1, 2), keepdims=True) + 1e-6)
    return u[:, None].astype(np.float32), y.astype(np.int64)


def random_blobs(rng, n: int, size: int) -> np.ndarray:
    """n rough fields of `size` x `size` with three Gaussian blobs each (the initial conditions of heat fields)."""
    grid = np.arange(size, dtype=np.float32)
    xx, yy = np.meshgrid(grid, grid, indexing="ij")
    u = rng.normal(0, 0.3, (n, size, size)).astype(np.float32)  # rough background the diffusion smooths
    for _ in range(3):
        cx, cy = rng.uniform(0, size, (2, n, 1, 1)).astype(np.float32)
        width = rng.uniform(0.5, 2.0, (n, 1, 1)).astype(np.float32)
        amp = rng.uniform(0.5, 1.5, (n, 1, 1)).astype(np.float32)
        u += amp * np.exp(-((xx - cx) ** 2 + (yy - cy) ** 2) / (2 * width ** 2))
    return u


def digits() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's shipped 8x8 digits (1797 samples, 10 classes), scaled to [0, 1]."""
    from sklearn.datasets import load_digits
    d = load_digits()
    x = (d.images / 16.0).astype(np.float32)[:, None]
    return x, d.target.astype(np.int64)


def from_npz(path: str) -> tuple[np.ndarray, np.ndarray]:
    """Arrays x (N,C,H,W) and y (N,) from a .npz file on disk (a real data set, pointed at by data.path)."""
    try:
        with np.load(path) as f:
            x, y = f["x"], f["y"]
    except FileNotFoundError:
        raise SpecError("data.path", f"{path} does not exist") from None
    except KeyError as e:
        raise SpecError("data.path", f"{path} has no array {e}; it needs x (N,C,H,W) and y (N,)") from None
    if x.ndim != 4 or y.ndim != 1 or len(x) != len(y):
        raise SpecError("data.path", f"{path}: x has shape {x.shape} and y {y.shape}; expected x (N,C,H,W), y (N,)")
    return x.astype(np.float32), y.astype(np.int64)
