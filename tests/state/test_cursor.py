"""Tests of wds_pad.state.cursor: the one record of where a loader is in its plan.

A cursor is frozen; ``Position(epoch, index)`` is a cursor; a finished epoch iterates
again from its start unless the cursor is pinned (``rewound``); ``forward`` counts
batches across epochs in steps mode; ``restore`` gives back a pinned cursor.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import numpy as np
import pytest

import wds_pad
from wds_pad import ConfigError, Dataset, Mode, StateError, Topology
from wds_pad.core.elastic.remainder import Segment
from wds_pad.state import elastic_view, make_state, restore
from wds_pad.state.cursor import Cursor, Position, ShardProgress, WorkerPosition, epoch_length
from wds_pad.state.spec import PlanSpec


class _Ix:
    """The least an Index offers a PlanSpec: a dataset and a digest."""

    def __init__(self, sizes: dict[str, int]) -> None:
        self.buckets = {k: np.arange(sum(list(sizes.values())[:i]), sum(list(sizes.values())[:i + 1]))
                        for i, k in enumerate(sizes)}
        self.digest = "0" * 32
        self.path = None

    def to_dataset(self, name: str, repeats: int = 0, weight: float = 1.0) -> Dataset:
        return Dataset(name, self.buckets, repeats=repeats, weight=weight)


def _spec(mode: Mode = Mode.EPOCHS, topology: Topology = Topology(1, 0), **kw: Any) -> PlanSpec:
    return PlanSpec(indexes=(_Ix({"a": 10, "b": 7}),), names=("d",), topology=topology,  # type: ignore[arg-type]
                    seed=3, batch_size=2, mode=mode, **kw)


def test_position_is_a_cursor_and_checks_its_fields() -> None:
    assert wds_pad.Position is Position is Cursor
    c = Position(3, 4)
    assert (c.epoch, c.index, c.view, c.worker, c.pinned, c.shards) == (3, 4, None, None, False, ShardProgress())
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.index = 5  # type: ignore[misc]
    for bad in (dict(epoch=-1), dict(index=True), dict(index=1.0), dict(epoch=2**31)):
        with pytest.raises(ConfigError, match="Cursor"):
            Cursor(**bad)  # type: ignore[arg-type]
    with pytest.raises(StateError, match="'offset' must be an int >= 0"):
        WorkerPosition(0, -1, 0)
    assert ShardProgress((WorkerPosition(1, 2, 3), WorkerPosition(0, 0, 4))).yielded == 7


def test_at_moves_only_the_epoch_and_index() -> None:
    c = Cursor(1, 2, worker=(1, 2), pinned=True, shards=ShardProgress(done=True))
    moved = c.at(4, 9)
    assert (moved.epoch, moved.index) == (4, 9) and c.index == 2
    assert (moved.worker, moved.pinned, moved.shards) == (c.worker, c.pinned, c.shards)
    assert moved == Cursor(4, 9, worker=(1, 2), pinned=True, shards=ShardProgress(done=True))


def test_a_finished_epoch_rewinds_unless_pinned_or_in_steps_mode() -> None:
    spec = _spec()
    n = len(spec.plan(0))
    assert Cursor(0, n - 1).rewound(spec) == Cursor(0, n - 1)
    assert Cursor(0, n).rewound(spec) == Cursor(0, 0)
    assert Cursor(0, n, pinned=True).rewound(spec) == Cursor(0, n, pinned=True)  # a restored end: nothing left
    steps = _spec(Mode.STEPS)
    assert Cursor(0, len(steps.plan(0))).rewound(steps).index == len(steps.plan(0))
    # the rewound epoch is planned on this layout: the elastic view is given up
    spec4 = _spec(topology=Topology(4, 1))
    view = elastic_view(spec4, 0, (Segment(2, steps=1),))
    c = Cursor(0, len(view.plan), view=view)
    assert c.length(spec4) == epoch_length(spec4, 0, view) == len(view.plan)
    assert c.rewound(spec4) == Cursor(0, 0)


def test_forward_crosses_epochs_in_steps_mode_and_stops_at_the_end_in_epochs_mode() -> None:
    spec = _spec()
    n = len(spec.plan(0))
    assert Cursor(0, n - 2).forward(spec, 5) == Cursor(0, n)
    steps = _spec(Mode.STEPS)
    n0, n1 = len(steps.plan(0)), len(steps.plan(1))
    assert Cursor(0, n0 - 1).forward(steps, 1) == Cursor(1, 0)
    assert Cursor(0, 1).forward(steps, n0 + n1) == Cursor(2, 1)


def test_restore_gives_a_pinned_cursor_and_make_state_takes_one() -> None:
    spec = _spec()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        state = make_state(spec, Cursor(0, 3))
    assert (state["epoch"], state["index"], state["batches_in_epoch"]) == (0, 3, len(spec.plan(0)))
    assert "worker" not in state and make_state(spec, Cursor(0, 3, worker=(1, 2)))["worker"] == {"id": 1, "num_workers": 2}
    assert restore(spec, state) == Cursor(0, 3, pinned=True)
    end = make_state(spec, Cursor(0, len(spec.plan(0))))
    assert restore(spec, end).rewound(spec).index == len(spec.plan(0))  # resuming at the end yields nothing
