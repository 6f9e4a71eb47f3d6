"""Proportions (core/planning/proportion.py): each dataset's share of an epoch, in samples or cost;
a subsampled dataset uses every sample before any twice; without proportions, nothing moves."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from wds_pad.core.budgets.budget import Budget
from wds_pad.core.dataset import Dataset
from wds_pad.core.planning.plan import plan_epoch
from wds_pad.core.planning.proportion import mix
from wds_pad.core.topology import Topology
from wds_pad.errors import ConfigError

SETTINGS = settings(max_examples=15, deadline=None)


def _datasets(c: dict[str, Any]) -> list[Dataset]:
    rng = np.random.default_rng(c["data_seed"])
    out = []
    for i, (n, p, mean) in enumerate(zip(c["sizes"], c["proportions"], c["means"])):
        cut = n // 3
        out.append(Dataset(f"d{i}", {"short": np.arange(cut), "long": np.arange(cut, n)},
                           cost=rng.integers(mean // 2, mean * 2, n), proportion=p))
    return out


def _totals(dss: list[Dataset], dp: int, epoch: int, mix_by: str, **kw: Any) -> tuple[dict[str, float], dict]:
    """Per dataset: its planned samples (or cost) over every rank, and its real sample ids."""
    total: dict[str, float] = {ds.name: 0.0 for ds in dss}
    real: dict[str, list[int]] = {ds.name: [] for ds in dss}
    cost = {ds.name: ds.cost for ds in dss}
    for r in range(dp):
        for b in plan_epoch(dss, Topology(dp, r), seed=3, epoch=epoch, batch_size=4, mix_by=mix_by, warn=False, **kw):
            total[b.dataset] += float(cost[b.dataset][b.samples].sum()) if mix_by == "cost" else b.samples.size
            real[b.dataset].extend(b.samples[~b.pad].tolist())
    return total, real


def _entries(dss: list[Dataset], dp: int, epoch: int, mix_by: str) -> dict[str, int]:
    """Per dataset: its planned entries over every rank, copies included."""
    out = {ds.name: 0 for ds in dss}
    for r in range(dp):
        for b in plan_epoch(dss, Topology(dp, r), seed=3, epoch=epoch, batch_size=4, mix_by=mix_by, warn=False):
            out[b.dataset] += b.samples.size
    return out


mixes = st.fixed_dictionaries({
    "sizes": st.lists(st.integers(3000, 8000), min_size=2, max_size=3),
    "proportions": st.lists(st.floats(0.2, 1.0), min_size=3, max_size=3),
    "means": st.lists(st.integers(20, 2000), min_size=3, max_size=3),
    "data_seed": st.integers(0, 2**16),
    "dp": st.integers(1, 4),
    "mix_by": st.sampled_from(["samples", "cost"]),
    "epoch": st.integers(0, 5),
})


@SETTINGS
@given(mixes)
@example({"sizes": [3000, 3000], "proportions": [1.0, 0.5, 1.0], "means": [20, 165, 20], "data_seed": 1,
          "dp": 4, "mix_by": "cost", "epoch": 2})  # 19 pad copies of a 1117-sample window: 1% over
def test_each_dataset_takes_its_proportion_of_the_epoch_within_one_percent(c: dict[str, Any]) -> None:
    """Within 1%, and the pad rule's copies on top: at most one global step a bucket (the
    planned entries before padding are what ``mix`` chose: a window, or each bucket's target)."""
    dss = _datasets(c)
    total, _ = _totals(dss, c["dp"], c["epoch"], c["mix_by"])
    entries = _entries(dss, c["dp"], c["epoch"], c["mix_by"])
    chosen = mix(dss, 3, c["epoch"], c["mix_by"])
    p = np.asarray([ds.proportion for ds in dss])
    want = p / p.sum()
    got = np.asarray([total[ds.name] for ds in dss]) / sum(total.values())
    slack = np.zeros(len(dss))
    for i, (ds, sub) in enumerate(zip(dss, chosen.datasets)):
        before = sum(chosen.targets.get((i, k), len(b)) for k, b in sub.buckets.items())
        padded = entries[ds.name] - before
        assert 0 <= padded < len(sub.buckets) * c["dp"] * 4, (ds.name, padded)
        dearest = float(ds.cost.max()) if c["mix_by"] == "cost" else 1.0
        slack[i] = padded * dearest / sum(total.values())
    assert np.all(np.abs(got - want) <= 0.01 * want + slack), (got, want, slack)


@SETTINGS
@given(mixes, st.integers(2, 6))
def test_a_subsampled_dataset_uses_every_sample_before_any_twice(c: dict[str, Any], epochs: int) -> None:
    dss = _datasets(c)
    big = max(dss, key=lambda ds: sum(len(b) for b in ds.buckets.values()))
    small = Dataset("small", {"x": np.arange(200)}, cost=np.full(200, float(np.mean(big.cost))), proportion=0.2)
    n = sum(len(b) for b in big.buckets.values())
    uses = np.zeros(n, np.int64)
    for e in range(epochs):
        _, real = _totals([big, small], c["dp"], e, c["mix_by"])
        ids = np.asarray(real[big.name], np.int64)
        assert np.unique(ids).size == ids.size  # a subset: nothing twice in one epoch
        np.add.at(uses, ids, 1)
        assert uses.max() - uses.min() <= 1  # nobody's second use before everybody's first
    # and each epoch draws another subset (big is one: its 80% of the epoch is under its size)
    first, second = (set(_totals([big, small], 1, e, c["mix_by"])[1][big.name]) for e in (0, 1))
    assert first != second


@SETTINGS
@given(mixes)
def test_a_dataset_below_its_share_is_extended_by_marked_copies(c: dict[str, Any]) -> None:
    dss = _datasets(c)
    small = Dataset("small", {"x": np.arange(150)}, cost=np.full(150, 50), proportion=0.5)
    _, real = _totals([dss[0], small], c["dp"], c["epoch"], "samples")
    plans = [plan_epoch([dss[0], small], Topology(c["dp"], r), seed=3, epoch=c["epoch"], batch_size=4, warn=False)
             for r in range(c["dp"])]
    entries = [(int(s), bool(p)) for plan in plans for b in plan if b.dataset == "small"
               for s, p in zip(b.samples, b.pad)]
    assert sorted(s for s, p in entries if not p) == list(range(150))  # every sample once, unmarked
    assert sum(p for _, p in entries) > 150  # the rest of its share: marked copies


def test_proportions_are_all_or_nothing_and_need_a_count() -> None:
    a = Dataset("a", {0: np.arange(100)}, cost=np.ones(100), proportion=1.0)
    b = Dataset("b", {0: np.arange(100)}, cost=np.ones(100))
    topo = Topology(1, 0)
    with pytest.raises(ConfigError, match=r"\['b'\] have no proportion"):
        plan_epoch([a, b], topo, seed=0, batch_size=4)
    with pytest.raises(ConfigError, match="--epoch-size"):
        plan_epoch([b], topo, seed=0, batch_size=4, epoch_size=50)
    with pytest.raises(ConfigError, match="mix_by must be one of"):
        plan_epoch([a], topo, seed=0, batch_size=4, mix_by="tokens")
    with pytest.raises(ConfigError, match="sample count"):
        plan_epoch([a], topo, seed=0, batch_size=Budget(10.0))
    with pytest.raises(ConfigError, match="proportion must be"):
        Dataset("c", {0: np.arange(3)}, proportion=0)


def test_without_proportions_the_plan_does_not_move() -> None:
    ds = Dataset("a", {0: np.arange(37), 1: np.arange(37, 90)}, weight=2.0)
    one = plan_epoch(ds, Topology(3, 1), seed=4, epoch=2, batch_size=4, oversubscribe=True)
    two = plan_epoch(ds, Topology(3, 1), seed=4, epoch=2, batch_size=4, oversubscribe=True, mix_by="samples")
    assert [b.to_json(one.topology) for b in one] == [b.to_json(two.topology) for b in two]
