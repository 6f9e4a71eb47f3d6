"""Tests of the epoch schedule (wds_pad/core/planning/schedule.py): every bucket's steps in order,
datasets interleaved at rates equal to their weights, the same on every call."""

from __future__ import annotations

from typing import Any, Hashable

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from wds_pad import Dataset, Topology, plan_epoch
from wds_pad.core.planning.schedule import step_schedule


def test_dataset_weights_act_as_poisson_rates() -> None:
    a = Dataset("a", {"x": np.arange(400)}, weight=3.0)
    b = Dataset("b", {"x": np.arange(400)}, weight=1.0)
    for seed in range(5):
        plan = plan_epoch([a, b], Topology(1, 0), seed=seed, batch_size=1)
        first = [plan.bucket_table[t][0] for t in plan.schedule[:200].tolist()]
        # rate 3 vs 1: about 150 of the first 200 steps come from "a"
        assert 125 <= first.count(0) <= 175
        assert plan.steps == 800
    even = plan_epoch([Dataset("a", {"x": np.arange(400)}, weight=2.0), Dataset("b", {"x": np.arange(400)}, weight=2.0)],
                      Topology(1, 0), seed=0, batch_size=1)
    first = [even.bucket_table[t][0] for t in even.schedule[:200].tolist()]
    assert 75 <= first.count(0) <= 125


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.floats(0.1, 10.0), st.lists(st.integers(0, 12), max_size=4)), min_size=1, max_size=3),
       st.integers(0, 2**64 - 1), st.integers(0, 5))
def test_each_bucket_takes_its_steps_in_window_order(spec: list[Any], seed: int, epoch: int) -> None:
    dss = [Dataset(f"ds{i}", {}, weight=w) for i, (w, _) in enumerate(spec)]
    table: list[tuple[int, Hashable]] = [(di, k) for di, (_, steps) in enumerate(spec) for k in range(len(steps))]
    steps = [s for _, per_bucket in spec for s in per_bucket]
    schedule, window = step_schedule(dss, table, steps, seed, epoch)
    assert schedule.dtype == np.int16 and window.dtype == np.int32  # O(steps): stored narrow
    assert np.bincount(schedule, minlength=len(table)).tolist() == steps
    for b in range(len(table)):  # window k of a bucket is its k-th step
        assert window[schedule == b].tolist() == list(range(steps[b]))
    again = step_schedule(dss, table, steps, seed, epoch)
    assert schedule.tobytes() == again[0].tobytes() and window.tobytes() == again[1].tobytes()
