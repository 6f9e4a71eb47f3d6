"""Packed batches: the Pack record, best fit over windows, plan_epoch and the remainder under a Pack.

Hypothesis properties over random costs, pack sizes, policies, accumulation steps and
dp/cp layouts, both localities: every pack within seq_len and max_segments, every batch
B packs, every sample in exactly one real slot per epoch, equal steps per DP rank, CP
peers identical, exact resume at any step and elastic resume from W to W' losing and
duplicating nothing.
"""

from __future__ import annotations

import warnings
from collections import Counter
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from wds_pad import ConfigError, Dataset, DroppedBucketWarning, Pack, ShardMap, Topology, plan_epoch
from wds_pad.core.budgets.packing import best_fit_windows
from wds_pad.core.elastic.remainder import Segment, plan_remainder

PROPERTY = settings(max_examples=80, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def test_a_pack_is_checked_when_built_naming_the_field() -> None:
    assert Pack(8192, packs=4).to_json() == {"seq_len": 8192, "packs": 4, "max_segments": None, "oversize": "refuse"}
    for bad, field in [((0,), "seq_len"), ((10, 0), "packs"), ((10, 1, 0), "max_segments"),
                       ((10, 1, None, "skip"), "oversize"), ((True,), "seq_len")]:
        with pytest.raises(ConfigError, match=field):
            Pack(*bad)


@settings(max_examples=200, deadline=None)
@given(weights=st.lists(st.integers(0, 60), max_size=80), limit=st.integers(1, 100),
       cap=st.integers(0, 5), window=st.integers(1, 30))
def test_best_fit_places_every_item_once_within_the_limit(weights: list[int], limit: int, cap: int,
                                                          window: int) -> None:
    order, offsets = best_fit_windows(np.asarray(weights, float), limit, cap, window)
    assert sorted(order.tolist()) == list(range(len(weights)))
    w = np.asarray(weights, float)
    for lo, hi in zip(offsets[:-1], offsets[1:]):
        members = order[lo:hi]
        assert hi > lo
        assert members.tolist() == sorted(members.tolist())  # the seeded order inside a pack
        if members.size > 1:
            assert w[members].sum() <= limit and (not cap or members.size <= cap)


def test_best_fit_fills_packs_fuller_than_first_fit_in_order() -> None:
    rng = np.random.default_rng(0)
    w = np.minimum(np.round(rng.lognormal(np.log(400), 1.0, 20000)), 8192)
    order, offsets = best_fit_windows(w, 8192)
    assert w.sum() / ((offsets.size - 1) * 8192) > 0.97


@st.composite
def pack_case(draw: Any) -> dict[str, Any]:
    sizes = draw(st.lists(st.integers(0, 40), min_size=1, max_size=3))
    total = sum(sizes)
    rng = np.random.default_rng(draw(st.integers(0, 2**32)))
    ids, cost = rng.permutation(total), rng.integers(1, 40, max(total, 1)).astype(float)
    buckets, at = {}, 0
    for b, n in enumerate(sizes):
        buckets[f"b{b}"] = ids[at:at + n]
        at += n
    return dict(ds=Dataset("d", buckets, repeats=draw(st.integers(0, 1)), cost=cost), cost=cost,
                pack=Pack(int(draw(st.integers(40, 120))), packs=draw(st.integers(1, 3)),
                          max_segments=draw(st.one_of(st.none(), st.integers(1, 4)))),
                policy=draw(st.sampled_from(["cyclic", "drop"])), dp=draw(st.integers(1, 4)),
                cp=draw(st.integers(1, 2)), k=draw(st.integers(1, 2)), pad_to=draw(st.sampled_from(["batch", "rank"])),
                locality=draw(st.sampled_from(["none", "shard"])), shards=rng.integers(0, 5, max(total, 1)))


def _src(case: dict[str, Any]) -> Any:
    return case["ds"] if case["locality"] == "none" else ShardMap(case["ds"], shard=case["shards"])


def _kw(case: dict[str, Any]) -> dict[str, Any]:
    return dict(seed=5, epoch=1, batch_size=case["pack"], policy=case["policy"], pad_to=case["pad_to"],
                accumulation_steps=case["k"], oversubscribe=True, locality=case["locality"], window=2)


def _check_packs(batch: Any, cost: np.ndarray, pack: Pack) -> None:
    assert batch.pack is not None and batch.pack.size == batch.samples.size
    assert np.all(np.diff(batch.pack) >= 0)
    for p in range(pack.packs):
        seg = cost[batch.samples[batch.pack == p]]
        assert seg.size >= 1                               # every batch is B packs
        assert seg.sum() <= pack.seq_len
        assert pack.max_segments is None or seg.size <= pack.max_segments


@PROPERTY
@given(case=pack_case())
def test_packed_ranks_take_equal_steps_and_every_sample_one_real_slot(case: dict[str, Any]) -> None:
    n = case["dp"] * case["cp"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DroppedBucketWarning)
        plans = [plan_epoch(_src(case), Topology(n, r, cp_size=case["cp"]), **_kw(case)) for r in range(n)]
    steps = [[(b.step, b.bucket) for b in p] for p in plans]
    assert all(s == steps[0] for s in steps) and len(steps[0]) % case["k"] == 0
    seen: Counter[int] = Counter()
    for r, p in enumerate(plans):
        if r % case["cp"]:
            q = plans[r - r % case["cp"]]
            assert [(b.samples.tolist(), b.pack.tolist()) for b in p] == \
                [(b.samples.tolist(), b.pack.tolist()) for b in q]
            continue
        for b in p:
            _check_packs(b, case["cost"], case["pack"])
            seen.update(b.samples[~b.pad].tolist())
    passes = 1 + case["ds"].repeats
    kept = {s.bucket for s in plans[0].stats if not s.dropped}
    for key, ids in case["ds"].buckets.items():
        for i in np.asarray(ids).tolist():
            if case["policy"] == "drop" or key not in kept:
                assert seen[i] <= passes
            else:
                assert seen[i] == passes


def _consume(plans: list[Any], upto: int, into: Counter[int]) -> None:
    for plan in plans:
        for i in range(upto):
            b = plan[i]
            into.update(b.samples[~b.pad].tolist())


@PROPERTY
@given(case=pack_case(), data=st.data(), layouts=st.lists(st.integers(1, 4), min_size=1, max_size=2))
def test_a_packed_epoch_resumed_exactly_or_on_other_layouts_trains_each_entry_once(
        case: dict[str, Any], data: Any, layouts: list[int]) -> None:
    kw = _kw(case)
    dp0 = case["dp"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DroppedBucketWarning)
        first = [plan_epoch(_src(case), Topology(dp0, r), **kw) for r in range(dp0)]
    want: Counter[int] = Counter()
    _consume(first, len(first[0]), want)
    got: Counter[int] = Counter()
    plans, segments = first, []
    for dp in [dp0] + layouts:
        steps = data.draw(st.integers(0, len(plans[0])))
        segments.append(Segment(len(plans), steps=steps))
        _consume(plans, steps, got)
        rest = [plan_remainder(_src(case), Topology(dp, r), segments, **kw) for r in range(dp)]
        assert len({x.fingerprint for x in rest}) == 1
        new = [x.plan for x in rest]
        assert len({len(p) for p in new}) == 1 and len(new[0]) % case["k"] == 0
        if len(segments) == 1:
            # exact resume on the same layout: the plan made again in a new process (pure)
            # replays the rest of the epoch batch for batch, packs included
            again = [plan_epoch(_src(case), Topology(dp0, r), warn=False, **kw) for r in range(dp0)]
            assert [[(b.samples.tolist(), b.pack.tolist()) for b in p.batches(steps, len(p))] for p in again] == \
                [[(b.samples.tolist(), b.pack.tolist()) for b in p][steps:] for p in plans]
        for p in new:
            for b in p:
                _check_packs(b, case["cost"], case["pack"])
        plans = new
    _consume(plans, len(plans[0]), got)
    assert got == want


def test_a_sample_longer_than_seq_len_is_refused_with_its_count_unless_it_travels_alone() -> None:
    cost = np.asarray([10, 50, 60, 5, 7, 3, 2, 1], float)
    ds = Dataset("d", {"a": np.arange(8)}, cost=cost)
    with pytest.raises(ConfigError, match=r"2 sample\(s\) cost more than seq_len 40.*oversize='alone'"):
        plan_epoch(ds, Topology(1, 0), seed=1, batch_size=Pack(40, packs=2))
    plan = plan_epoch(ds, Topology(1, 0), seed=1, batch_size=Pack(40, packs=2, oversize="alone"))
    packs = [b.samples[b.pack == p] for b in plan for p in range(2)]
    assert all(cost[s].sum() <= 40 or s.size == 1 for s in packs)  # a costlier sample alone in its pack
    assert sorted(s.tolist() for s in packs if cost[s].sum() > 40) in ([[1], [2]], [[1], [1], [2]], [[1], [2], [2]])


def test_packing_needs_costs_and_names_the_dataset_without() -> None:
    with pytest.raises(ConfigError, match="dataset 'd' has no costs"):
        plan_epoch(Dataset("d", {"a": np.arange(8)}), Topology(2, 0), seed=1, batch_size=Pack(4, packs=2))


def test_packing_needs_a_padding_policy_that_keeps_ranks_equal() -> None:
    ds = Dataset("d", {"a": np.arange(8)}, cost=np.ones(8))
    with pytest.raises(ConfigError, match="policy 'none'"):
        plan_epoch(ds, Topology(2, 0), seed=1, batch_size=Pack(4, packs=2), policy="none")
