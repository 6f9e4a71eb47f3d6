"""An epoch planned under a budget, resumed on other numbers of DP ranks: the remainder.

Hypothesis properties over random costs, budgets, policies, accumulation steps, both
localities and chains of two or three layouts: what every layout's ranks consumed is the
epoch's real entries, each exactly once; the remainder's batches stay within the budget,
equal in count (a multiple of K) on every new rank; the fingerprint is the same on all.
"""

from __future__ import annotations

import warnings
from collections import Counter
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from wds_pad import Budget, Dataset, DroppedBucketWarning, ShardMap, Topology, plan_epoch
from wds_pad.core.budgets.budget import batch_cost
from wds_pad.core.elastic.remainder import Segment, plan_remainder
from wds_pad.errors import StateMismatchError

PROPERTY = settings(max_examples=120, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _consume(plans: list[Any], upto: list[int], into: Counter[int]) -> None:
    for plan, n in zip(plans, upto):
        for i in range(n):
            b = plan[i]
            into.update(b.samples[~b.pad].tolist())


@PROPERTY
@given(data=st.data(), sizes=st.lists(st.integers(0, 40), min_size=1, max_size=3), seed=st.integers(0, 2**32),
       locality=st.sampled_from(["none", "shard"]), policy=st.sampled_from(["cyclic", "drop", "none"]),
       model=st.sampled_from(["sum", "max"]), repeats=st.integers(0, 1),
       layouts=st.lists(st.integers(1, 4), min_size=2, max_size=3))
def test_a_budgeted_epoch_resumed_on_other_layouts_trains_each_entry_once(
        data: Any, sizes: list[int], seed: int, locality: str, policy: str, model: str, repeats: int,
        layouts: list[int]) -> None:
    rng = np.random.default_rng(seed)
    total = sum(sizes)
    ids, cost = rng.permutation(total), rng.lognormal(3, 0.6, total)
    buckets, at = {}, 0
    for b, n in enumerate(sizes):
        buckets[b] = ids[at:at + n]
        at += n
    ds = Dataset("d", buckets, repeats=repeats, cost=cost)
    src = ds if locality == "none" else ShardMap(ds, shard=rng.integers(0, 5, max(total, 1)))
    k = 1 if policy == "none" else data.draw(st.integers(1, 2))
    budget = Budget(float((cost.max() if total else 1.0) * data.draw(st.floats(1, 4))), model)
    kw = dict(seed=3, epoch=1, batch_size=budget, policy=policy, locality=locality, window=2,
              accumulation_steps=k, oversubscribe=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DroppedBucketWarning)
        first = [plan_epoch(src, Topology(layouts[0], r), **kw) for r in range(layouts[0])]
    want: Counter[int] = Counter()
    _consume(first, [len(p) for p in first], want)
    got: Counter[int] = Counter()
    plans, segments = first, []
    for dp in layouts[1:]:
        if policy == "none":
            pos = [data.draw(st.integers(0, len(p))) for p in plans]
            segments.append(Segment(len(plans), positions=tuple(pos)))
        else:
            steps = data.draw(st.integers(0, len(plans[0])))
            pos = [steps] * len(plans)
            segments.append(Segment(len(plans), steps=steps))
        _consume(plans, pos, got)
        rest = [plan_remainder(src, Topology(dp, r), segments, **kw) for r in range(dp)]
        assert len({x.fingerprint for x in rest}) == 1
        plans = [x.plan for x in rest]
        # the remainder pads to what a fresh plan of its layout pads to (lockstep: dp x k)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DroppedBucketWarning)
            fresh = plan_epoch(src, Topology(dp, 0), **kw).pad_unit
        assert fresh == dp * (k if locality == "shard" else 1)
        assert {p.pad_unit for p in plans} == {fresh}
        if policy != "none":
            assert all(s.padded_length % fresh == 0 for s in plans[0].stats)
            assert len({len(p) for p in plans}) == 1 and len(plans[0]) % k == 0
            assert all([b.step for b in p] == [b.step for b in plans[0]] for p in plans)
        for p in plans:
            for b in p:
                c = cost[b.samples]
                assert c.size <= 1 or batch_cost(c, budget.model) <= budget.limit * (1 + 1e-9)
    _consume(plans, [len(p) for p in plans], got)
    assert got == want


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), seed=st.integers(0, 2**32), small=st.integers(1, 6), dp=st.integers(1, 3))
def test_a_budgeted_shard_remainder_reads_whole_the_shards_of_each_dataset_it_visits_twice(
        data: Any, seed: int, small: int, dp: int) -> None:
    # two datasets; the first one's small bucket is used up early, so the remainder's bucket
    # table is shorter than the epoch's and its indices no longer line up with it
    rng = np.random.default_rng(seed)
    sizes = {"a": [small, 30], "b": [30]}
    srcs, costs = [], {}
    for name, ns in sizes.items():
        n = sum(ns)
        cost = rng.lognormal(3, 0.4, n)
        ids, at, buckets = rng.permutation(n), 0, {}
        for b, m in enumerate(ns):
            buckets[b], at = ids[at:at + m], at + m
        srcs.append(ShardMap(Dataset(name, buckets, cost=cost), shard=rng.integers(0, 4, n)))
        costs[name] = cost
    budget = Budget(float(max(c.max() for c in costs.values()) * 2.5), "sum")
    kw = dict(seed=5, epoch=0, batch_size=budget, policy="cyclic", locality="shard", window=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DroppedBucketWarning)
        first = [plan_epoch(srcs, Topology(2, r), **kw) for r in range(2)]
        steps = data.draw(st.integers(0, len(first[0])))
        for r in range(dp):
            plan = plan_remainder(srcs, Topology(dp, r), [Segment(2, steps=steps)], **kw).plan
            for di, src in enumerate(srcs):
                shard = np.concatenate([src.shard[b.samples] for b in plan if b.dataset == src.dataset.name] or
                                       [np.zeros(0, np.int64)])
                uniq, first_use, count = np.unique(shard, return_index=True, return_counts=True)
                want = uniq[count >= 2][np.argsort(first_use[count >= 2], kind="stable")]
                assert plan.buckets.local.rank_shards(di).tolist() == want.tolist()


def test_refusals_name_what_is_wrong_for_every_locality() -> None:
    cost = np.arange(1.0, 41.0)
    ds = Dataset("d", {0: np.arange(40)}, cost=cost)
    budget = Budget(60.0)
    for src, locality in ((ds, "none"), (ShardMap(ds, shard=np.arange(40) % 4), "shard")):
        kw = dict(seed=1, epoch=0, batch_size=budget, locality=locality)
        with pytest.raises(StateMismatchError, match="position 99 is past the end of epoch 0 on dp_size 2"):
            plan_remainder(src, Topology(1, 0), [Segment(2, steps=99)], policy="cyclic", **kw)
        with pytest.raises(StateMismatchError, match="position 50 of dp_rank 1 is past the end"):
            plan_remainder(src, Topology(1, 0), [Segment(2, positions=(1, 50))], policy="none", **kw)
