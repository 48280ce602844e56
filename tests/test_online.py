"""scalelab.experiments.online: a heat solver rank produces chunks while a trainer rank trains a surrogate on them."""
from __future__ import annotations

import numpy as np
import pytest

from scalelab.experiments import online


def test_the_solver_is_the_heat_equation_on_a_finer_grid():
    rng = np.random.default_rng(0)
    u0 = rng.normal(size=(3, 12, 12)).astype(np.float32)
    kappa = np.array([0.0, 0.1, 0.24], dtype=np.float32)
    u = online.solve(u0, kappa, steps=4, refine=2)
    assert np.allclose(u[0], u0[0], atol=1e-6)  # no diffusion: the field stays (block averages of a repeat)
    assert np.allclose(u.mean(axis=(1, 2)), u0.mean(axis=(1, 2)), atol=1e-4)  # heat is conserved (periodic)
    assert u[2].std() < u[1].std() < u0[1].std()  # more diffusivity, smoother
    assert [online.regime_of(c, 6) for c in range(6)] == [0, 0, 0, 1, 1, 1]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("online")
    (out / "my_keep.py").write_text("def keep(seen, capacity, rng):\n    raise NotImplementedError('exercise')\n")
    with pytest.MonkeyPatch.context() as mp:  # the student's module is found beside the "notebook"
        mp.chdir(out)
        done = online.compare(out / "runs", buffers=(0, 32), keep=None, chunks=4, chunk_size=16, size=16,
                              steps_per_chunk=4, held_out=16)
        unwritten = online.compare(out / "unwritten", buffers=(0, 32), keep="my_keep:keep", chunks=2,
                                   chunk_size=8, size=12, steps_per_chunk=1, held_out=8)
    return done, unwritten


def test_solver_and_trainer_are_separate_processes_that_run_at_once(runs):
    done, _ = runs
    for b, run in done["runs"].items():
        events = online.read_stream_events(run["dir"])
        assert sorted(events) == ["solver-0", "trainer-1"]
        assert {e["pid"] for e in events["solver-0"]} != {e["pid"] for e in events["trainer-1"]}
        lap = online.overlap(events)
        assert lap["chunks_produced"] == lap["chunks_trained"] == 4 and lap["consumed_before_produced"] == 0
        t = run["trainer"]
        assert len(t["error"]) == 2 and all(0 < e < 2 for e in t["error"]) and t["speedup"] > 0
        assert len(t["errors_after"]) == 2  # one evaluation at the drift, one at the end
    kept = done["runs"]["32"]["trainer"]["buffer_regimes"]  # 64 seen, 32 per regime: a full buffer holding both
    assert sum(kept) == 32 and min(kept) > 4
    assert done["not_implemented"] == []


def test_an_unwritten_keep_leaves_out_the_buffered_run_only(runs):
    _, unwritten = runs
    assert list(unwritten["runs"]) == ["0"] and unwritten["not_implemented"] == [32]


def test_a_stale_stream_is_cleared_before_a_run(tmp_path):
    online.compare(tmp_path, buffers=(0,), chunks=2, chunk_size=8, size=12, steps_per_chunk=1, held_out=8)
    (tmp_path / "buffer-0" / "stream" / "chunk-0005.npz").write_bytes(b"stale")
    again = online.compare(tmp_path, buffers=(0,), chunks=2, chunk_size=8, size=12, steps_per_chunk=1, held_out=8)
    assert not (tmp_path / "buffer-0" / "stream" / "chunk-0005.npz").exists()
    assert online.overlap(online.read_stream_events(again["runs"]["0"]["dir"]))["consumed_before_produced"] == 0
