"""Each planned sample's seed (core/sampleseed.py): the same for a (sample, epoch, copy)
whatever the layout, the rank or the resume point; another one every epoch and copy."""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import wds_pad
from wds_pad.core.dataset import Dataset
from wds_pad.core.planning.plan import plan_epoch
from wds_pad.core.elastic.remainder import Segment, plan_remainder
from wds_pad.core.sampleseed import sample_seeds
from wds_pad.core.topology import Topology

SETTINGS = settings(max_examples=25, deadline=None)


def _dataset(sizes: list[int], repeats: int) -> Dataset:
    start = np.cumsum([0] + sizes)
    return Dataset("d", {f"b{i}": np.arange(start[i], start[i + 1]) for i in range(len(sizes))}, repeats=repeats)


def _rows(plans: list[Any]) -> list[tuple[int, bool, int]]:
    """(sample, padded, seed) of every entry of every rank's plan."""
    return [(int(s), bool(p), int(z)) for plan in plans for b in plan for s, p, z in zip(b.samples, b.pad, b.seeds)]


def _epoch(ds: Dataset, dp: int, epoch: int = 0, **kw: Any) -> list[Any]:
    return [plan_epoch(ds, Topology(dp, r), seed=11, epoch=epoch, batch_size=2, warn=False, **kw) for r in range(dp)]


layouts = st.fixed_dictionaries({
    "sizes": st.lists(st.integers(0, 30), min_size=1, max_size=4),
    "repeats": st.integers(0, 2),
    "dp": st.integers(1, 5),
    "other": st.integers(1, 5),
    "pad": st.sampled_from(["cyclic", "drop"]),
})


@SETTINGS
@given(layouts)
def test_a_sample_has_the_same_seeds_on_every_layout(c: dict[str, Any]) -> None:
    ds = _dataset(c["sizes"], c["repeats"])
    a = _epoch(ds, c["dp"], policy="none")
    b = _epoch(ds, c["other"], policy="none")
    # policy none: every layout plans the same entries; each keeps its seed, whichever rank takes it
    assert Counter((s, z) for s, _, z in _rows(a)) == Counter((s, z) for s, _, z in _rows(b))
    # padded layouts: a sample's own entries keep their seeds, the copies added to pad are the layout's
    real = {(s, z) for s, p, z in _rows(_epoch(ds, c["dp"], policy=c["pad"], oversubscribe=c["pad"] == "cyclic"))
            if not p}
    assert real <= set(Counter((s, z) for s, _, z in _rows(a)))


@SETTINGS
@given(layouts)
def test_every_entry_of_an_epoch_has_its_own_seed_and_every_epoch_new_ones(c: dict[str, Any]) -> None:
    ds = _dataset(c["sizes"], c["repeats"])
    kw = {"policy": "cyclic", "oversubscribe": True}
    rows0 = _rows(_epoch(ds, c["dp"], 0, **kw))
    seeds0 = [z for _, _, z in rows0]
    assert len(set(seeds0)) == len(seeds0)  # each pass and each padded copy of a sample: its own seed
    seeds1 = {z for _, _, z in _rows(_epoch(ds, c["dp"], 1, **kw))}
    assert not seeds1 & set(seeds0)


@SETTINGS
@given(layouts, st.data())
def test_seeds_survive_a_resume_on_another_layout(c: dict[str, Any], data: st.DataObject) -> None:
    ds = _dataset(c["sizes"], c["repeats"])
    kw = {"seed": 11, "epoch": 0, "batch_size": 2, "policy": "cyclic", "oversubscribe": True}
    old = [plan_epoch(ds, Topology(c["dp"], r), warn=False, **kw) for r in range(c["dp"])]
    steps = data.draw(st.integers(0, old[0].steps))
    new = [plan_remainder(ds, Topology(c["other"], r), [Segment(c["dp"], steps=steps)], **kw).plan
           for r in range(c["other"])]
    seen = {(s, z) for plan in old for b in plan if b.step < steps for s, p, z in zip(b.samples, b.pad, b.seeds)
            if not p}
    rest = {(s, z) for s, p, z in _rows(new) if not p}
    everything = {(s, z) for s, p, z in _rows(old) if not p}
    # the remainder's own entries are exactly the ones not yet seen, each with the seed it had
    assert rest == everything - seen
    # and a batch's seeds are the same read alone or among others (any resume index)
    plan = old[0]
    for i in range(len(plan)):
        assert np.array_equal(plan[i].seeds, plan.batches(i, len(plan))[0].seeds)


@SETTINGS
@given(layouts, st.data())
def test_budgeted_plans_number_every_pass_and_keep_seeds_across_a_resume(c: dict[str, Any],
                                                                        data: st.DataObject) -> None:
    base = _dataset(c["sizes"], c["repeats"])
    cost = np.arange(sum(c["sizes"]), dtype=np.float64) % 7 + 1
    ds = Dataset("d", base.buckets, repeats=c["repeats"], cost=cost)
    kw = {"seed": 11, "epoch": 0, "batch_size": wds_pad.Budget(12.0), "policy": "cyclic", "oversubscribe": True}
    old = [plan_epoch(ds, Topology(c["dp"], r), warn=False, **kw) for r in range(c["dp"])]
    seeds = [z for _, _, z in _rows(old)]
    real = [(s, z) for s, p, z in _rows(old) if not p]
    assert len({z for _, z in real}) == len(real)  # each pass of a sample: its own seed
    steps = data.draw(st.integers(0, old[0].steps))
    new = [plan_remainder(ds, Topology(c["other"], r), [Segment(c["dp"], steps=steps)], **kw).plan
           for r in range(c["other"])]
    seen = {(s, z) for plan in old for b in plan if b.step < steps for s, p, z in zip(b.samples, b.pad, b.seeds)
            if not p}
    assert {(s, z) for s, p, z in _rows(new) if not p} == set(real) - seen
    assert len(seeds) == len(_rows(old))


def test_seeds_are_pinned_and_sample_rng_replays_them() -> None:
    # a change here changes every augmentation of every saved run: never change it silently
    got = sample_seeds(7, 3, "train", np.arange(3), 0).tolist()
    assert got == sample_seeds(7, 3, "train", np.arange(3), np.zeros(3, np.int64)).tolist()
    assert got == PINNED
    assert sample_seeds(7, 3, "train", [0], [1]).tolist() != got[:1]
    assert sample_seeds(7, 3, "val", [0], [0]).tolist() != got[:1]
    a = wds_pad.sample_rng({"__seed__": got[0]}).integers(0, 2**32, 4)
    assert np.array_equal(a, wds_pad.sample_rng(got[0]).integers(0, 2**32, 4))


def test_plan_json_rows_carry_seeds_parallel_to_samples() -> None:
    plan = plan_epoch(_dataset([5, 9], 0), Topology(2, 1), seed=3, batch_size=2, oversubscribe=True)
    for b in plan:
        row = b.to_json(plan.topology)
        assert len(row["seeds"]) == len(row["samples"])
        assert row["seeds"] == sample_seeds(3, 0, "d", b.samples, b.pad.astype(int)).tolist()


PINNED = [13774127413490830401, 10849187304493371355, 6520811756928369379]
