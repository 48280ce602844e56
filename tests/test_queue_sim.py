"""scalelab.experiments.queue_sim: a FIFO + EASY-backfill queue over a seeded trace, and a job chain submitted
reactively, early with afterok, or at a predicted time (Mirage-style)."""
from __future__ import annotations

import pytest

from scalelab.errors import SpecError
from scalelab.experiments import queue_sim as q


def test_the_scheduler_backfills_only_what_does_not_delay_the_head():
    sim = q.Simulator(nodes=4)
    a, b = q.Job(0, 0.0, 2, 2.0, 2.0), q.Job(1, 0.1, 4, 1.0, 1.0)
    c, d = q.Job(2, 0.2, 1, 1.0, 1.0), q.Job(3, 0.3, 1, 1.0, 3.0)
    for job in (a, b, c, d):
        sim.at(job.submit, sim.submit, job)
    sim.run()
    assert a.start == 0.0 and b.start == 2.0  # the head waits for A's two nodes
    assert c.start == 0.2  # fits beside A and ends (by its limit) before B's reservation at t=2
    assert d.start == 3.0  # would fit now too, but its 3 h limit runs past the reservation: waits its turn


def test_afterok_submission_leaves_a_smaller_idle_gap_than_reactive_on_the_same_trace():
    r = q.compare_policies(nodes=32, days=4, load=0.9, seed=0, links=4, link_hours=2.0, link_nodes=8)
    reactive, early = r["reactive"], r["afterok"]
    assert early["total_idle_h"] < reactive["total_idle_h"] and reactive["total_idle_h"] > 1.0
    assert early["makespan_h"] < reactive["makespan_h"]
    assert early["first_wait_h"] == reactive["first_wait_h"]  # the first link meets the same queue
    for figures in (reactive, early):  # a link's work never starts before its predecessor's checkpoint
        assert len(figures["idle_gap_h"]) == 3 and min(figures["idle_gap_h"]) >= 0
        assert figures["makespan_h"] == pytest.approx(figures["queue_h"] + 4 * 2.0)


def test_when_priority_counts_from_eligibility_afterok_buys_nothing_and_prediction_helps():
    reactive = afterok = predictive = overlap = 0.0
    for seed in range(5):
        r = q.compare_policies(seed=seed, priority="eligible", days=4)
        assert r["afterok"]["idle_gap_h"] == r["reactive"]["idle_gap_h"]
        reactive += r["reactive"]["total_idle_h"]
        afterok += r["afterok"]["total_idle_h"]
        predictive += r["predictive"]["total_idle_h"]
        overlap += r["predictive"]["overlap_node_h"]
    assert predictive < 0.8 * reactive  # submitted ahead of the predicted wait
    assert overlap > 0  # the price: nodes held while a link waited for its predecessor's checkpoint


def test_the_simulation_is_deterministic_for_a_seed():
    a, b = q.compare_policies(seed=3), q.compare_policies(seed=3)
    assert a == b
    assert q.compare_policies(seed=4)["trace"] != a["trace"]
    trace = q.background_trace(nodes=32, days=4, load=0.9, seed=3)
    assert a["trace"]["jobs"] == len(trace) and 0.6 < a["trace"]["offered_load"] < 1.2


@pytest.mark.parametrize("kwargs, field", [({"policy": "eager"}, "policy"), ({"priority": "fair"}, "priority"),
                                           ({"links": 1}, "links"), ({"link_nodes": 64}, "link_nodes")])
def test_a_bad_argument_names_itself(kwargs, field):
    with pytest.raises(SpecError) as e:
        q.simulate(q.background_trace(nodes=32, days=1, seed=0), 32, **kwargs)
    assert e.value.field == field
