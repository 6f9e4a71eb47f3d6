"""Budgets: the record, packing, strata and lockstep cuts, and plan_epoch under a budget.

The guarantees of a fixed batch size hold under a budget, each a hypothesis property
over random costs, budgets, bucket sizes, repeats, policies, accumulation steps and
dp/cp layouts, for both localities: every DP rank takes the same steps, at each step the
same bucket, CP peers get identical batches, every entry of an epoch exactly once (copies
marked), every batch within the budget (a sample dearer than it alone), each rank's
batch count a multiple of ``accumulation_steps`` with each run of K steps from one bucket.
"""

from __future__ import annotations

import warnings
from collections import Counter
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from wds_pad import Budget, ConfigError, Dataset, DroppedBucketWarning, ShardMap, Topology, plan_epoch
from wds_pad.core.budgets.budget import batch_cost, pack
from wds_pad.core.budgets.budgetplan import lockstep_cuts
from wds_pad.core.budgets.strata import BucketBatches

PROPERTY = settings(max_examples=200, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _within(costs: np.ndarray, budget: Budget) -> bool:
    return costs.size <= 1 or batch_cost(costs, budget.model) <= budget.limit * (1 + 1e-9)


# -- the record ------------------------------------------------------------------------------


def test_a_budget_is_checked_when_built_naming_the_field() -> None:
    assert Budget(8192).to_json() == {"limit": 8192.0, "model": "sum", "max_samples": None}
    assert Budget(100, "max", max_samples=4).model.value == "max"
    for bad, field in [((0,), "limit"), ((float("nan"),), "limit"), ((True,), "limit"), (("8k",), "limit"),
                       ((10, "mean"), "budget model"), ((10, "sum", 0), "max_samples")]:
        with pytest.raises(ConfigError, match=field):
            Budget(*bad)


def test_batch_cost_is_the_sum_or_count_times_the_largest() -> None:
    assert batch_cost([1, 2, 5], "sum") == 8
    assert batch_cost([1, 2, 5], "max") == 15
    assert batch_cost([], "max") == 0


@PROPERTY
@given(weights=st.lists(st.floats(0, 50, allow_nan=False), max_size=60), limit=st.floats(1, 100),
       model=st.sampled_from(["sum", "max"]), cap=st.one_of(st.none(), st.integers(1, 6)))
def test_pack_places_every_item_once_within_the_budget(weights: list[float], limit: float, model: str,
                                                       cap: int | None) -> None:
    budget = Budget(limit, model, cap)
    order, offsets = pack(np.asarray(weights), budget)
    assert sorted(order.tolist()) == list(range(len(weights)))
    w = np.asarray(weights)
    for lo, hi in zip(offsets[:-1], offsets[1:]):
        part = w[order[lo:hi]]
        assert hi > lo
        assert _within(part, budget)
        assert cap is None or part.size <= cap


# -- strata (locality none) ----------------------------------------------------------------


@PROPERTY
@given(n=st.integers(0, 60), passes=st.integers(1, 3), dp=st.integers(1, 8), seed=st.integers(0, 2**32),
       scale=st.floats(0.5, 6), model=st.sampled_from(["sum", "max"]),
       policy=st.sampled_from(["cyclic", "drop", "none"]), over=st.booleans(), top=st.booleans(),
       k=st.integers(1, 3))
def test_strata_give_every_rank_equal_batches_each_entry_once_within_budget(
        n: int, passes: int, dp: int, seed: int, scale: float, model: str, policy: str, over: bool, top: bool,
        k: int) -> None:
    rng = np.random.default_rng(seed)
    costs = np.sort(rng.lognormal(3, 1, n))
    budget = Budget(float(scale * (costs.max() if n else 1)), model)
    k = 1 if policy == "none" else k
    bb = BucketBatches(n, passes, dp, lambda pos: costs[pos], seed, budget, policy, over, top and policy == "cyclic", k)
    counts = [bb.count(d) for d in range(dp)]
    if policy != "none":
        assert len(set(counts)) == 1
    assert bb.batches % k == 0
    seen: Counter[tuple[int, int]] = Counter()
    for d in range(dp):
        kk = np.arange(counts[d])
        pos, ps, pad = bb.at(np.full(kk.size, d), kk)
        for w in range(bb.batches):
            lo, hi = bb.offsets[w], min(bb.offsets[w + 1], counts[d])
            if hi > lo and not np.any(bb.weights[bb.seq[lo:hi]] > budget.limit):
                assert _within(costs[pos[lo:hi]], budget)
        seen.update((int(x), int(p)) for x, p, q in zip(pos, ps, pad) if not q)
    assert set(seen.values()) <= {1}
    if policy != "drop" and not bb.dropped:
        assert len(seen) == n * passes
    assert bb.real == len(seen) and bb.truncated == n * passes - len(seen)


def test_strata_fill_a_sum_budget_and_balance_the_ranks_on_skewed_lengths() -> None:
    # log-normal token counts, one length band: batches >= 90 % full, and at every step the
    # costliest rank's batch within 1.10 x the step's mean
    rng = np.random.default_rng(0)
    costs = np.sort(np.clip(rng.lognormal(6.0, 0.9, 20000), 16, 4096))
    dp, budget = 8, Budget(16384)
    bb = BucketBatches(costs.size, 1, dp, lambda pos: costs[pos], 7, budget, "cyclic", False, True, 1)
    per_rank = np.stack([costs[bb.at(np.full(bb.count(d), d), np.arange(bb.count(d)))[0]] for d in range(dp)])
    fills, worst = [], 1.0
    for w in range(bb.batches):
        part = per_rank[:, bb.offsets[w]:bb.offsets[w + 1]].sum(axis=1)
        fills.append(part.mean() / budget.limit)
        worst = max(worst, part.max() / part.mean())
    assert np.mean(fills) >= 0.9 and worst <= 1.10


def test_the_member_runs_of_strata_are_their_real_members() -> None:
    costs = np.arange(23, dtype=float)
    bb = BucketBatches(23, 2, 4, lambda pos: costs[pos], 5, Budget(30), "cyclic", True, False, 1)
    starts, lengths = bb.member_runs(np.unique(bb.seq[~bb.copy]))
    got = sorted(int(s) + i for s, ln in zip(starts, lengths) for i in range(ln))
    assert got == list(range(46))  # every (pass, position) code once


# -- lockstep cuts (locality shard) ---------------------------------------------------------


@PROPERTY
@given(dp=st.integers(1, 6), r=st.integers(0, 40), seed=st.integers(0, 2**32), scale=st.floats(0.5, 8),
       model=st.sampled_from(["sum", "max"]), cap=st.one_of(st.none(), st.integers(1, 5)), k=st.integers(1, 3))
def test_lockstep_cuts_give_every_rank_the_same_count_within_budget(
        dp: int, r: int, seed: int, scale: float, model: str, cap: int | None, k: int) -> None:
    rng = np.random.default_rng(seed)
    costs = rng.lognormal(2, 1, (dp, max(r, 1)))
    budget = Budget(float(scale * costs.max()), model, cap)
    counts = np.full(dp, r)
    s, cuts = lockstep_cuts(costs, counts, budget, accumulation_steps=k)
    assert cuts.shape == (dp, s + 1)
    assert s == 0 or s % k == 0 or s == r
    for d in range(dp):
        assert cuts[d, 0] == 0 and cuts[d, -1] == r and np.all(np.diff(cuts[d]) >= 0)
        if r >= s:
            assert np.all(np.diff(cuts[d]) > 0)
        for w in range(s):
            part = costs[d, cuts[d, w]:cuts[d, w + 1]]
            assert _within(part, budget) and (cap is None or part.size <= cap)


# -- plan_epoch under a budget, both localities ------------------------------------------------


@st.composite
def budget_case(draw: Any) -> dict[str, Any]:
    sizes = draw(st.lists(st.integers(0, 40), min_size=1, max_size=4))
    total = sum(sizes)
    seed = draw(st.integers(0, 2**32))
    rng = np.random.default_rng(seed)
    ids = rng.permutation(total)
    cost = rng.lognormal(3, 0.8, total)
    buckets, at = {}, 0
    for b, n in enumerate(sizes):
        buckets[f"b{b}"] = ids[at:at + n]
        at += n
    policy = draw(st.sampled_from(["cyclic", "drop", "none"]))
    return dict(
        ds=Dataset("d", buckets, repeats=draw(st.integers(0, 2)), cost=cost), cost=cost,
        budget=Budget(float((cost.max() if total else 1.0) * draw(st.floats(1, 6))), draw(st.sampled_from(["sum", "max"]))),
        policy=policy, dp=draw(st.integers(1, 5)), cp=draw(st.integers(1, 2)),
        k=1 if policy == "none" else draw(st.integers(1, 3)), pad_to=draw(st.sampled_from(["batch", "rank"])),
        locality=draw(st.sampled_from(["none", "shard"])), over=draw(st.booleans()),
        shards=rng.integers(0, 6, max(total, 1)))


def _plans(case: dict[str, Any]) -> list[Any]:
    src = case["ds"] if case["locality"] == "none" else ShardMap(case["ds"], shard=case["shards"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DroppedBucketWarning)
        return [plan_epoch(src, Topology(case["dp"] * case["cp"], r, cp_size=case["cp"]), seed=11, epoch=2,
                           batch_size=case["budget"], policy=case["policy"], pad_to=case["pad_to"],
                           accumulation_steps=case["k"], oversubscribe=case["over"], locality=case["locality"],
                           window=2)
                for r in range(case["dp"] * case["cp"])]


@PROPERTY
@given(case=budget_case())
def test_under_a_budget_ranks_take_equal_steps_one_bucket_each_entry_once(case: dict[str, Any]) -> None:
    plans, cp, k = _plans(case), case["cp"], case["k"]
    steps = [[(b.step, b.dataset, b.bucket) for b in p] for p in plans]
    if case["policy"] != "none":
        assert all(s == steps[0] for s in steps)           # equal steps, the same bucket at each
        assert len(steps[0]) % k == 0
    sched = plans[0].schedule
    assert all(len(set(sched[i:i + k].tolist())) == 1 for i in range(0, sched.size, k))
    seen: Counter[int] = Counter()
    for r, p in enumerate(plans):
        if r % cp:                                          # CP peers: identical batches
            q = plans[r - r % cp]
            assert [b.samples.tolist() for b in p] == [b.samples.tolist() for b in q]
            continue
        for b in p:
            assert _within(case["cost"][b.samples], case["budget"])
            seen.update(b.samples[~b.pad].tolist())
    passes = 1 + case["ds"].repeats
    kept = {s.bucket for s in plans[0].stats if not s.dropped}
    for key, ids in case["ds"].buckets.items():
        for i in np.asarray(ids).tolist():
            if case["policy"] == "drop" or key not in kept:
                assert seen[i] <= passes
            else:
                assert seen[i] == passes


def test_a_dataset_without_costs_cannot_be_planned_under_a_budget() -> None:
    with pytest.raises(ConfigError, match="has no costs"):
        plan_epoch(Dataset("d", {"a": [0, 1, 2]}), Topology(1, 0), seed=1, batch_size=Budget(10))


def test_accumulation_steps_refuse_policy_none_and_pad_to_rank() -> None:
    ds = Dataset("d", {"a": list(range(20))})
    with pytest.raises(ConfigError, match="padding policy 'none'"):
        plan_epoch(ds, Topology(2, 0), seed=1, batch_size=2, policy="none", accumulation_steps=2)
    with pytest.raises(ConfigError, match="pad_to='rank'"):
        plan_epoch(ds, Topology(2, 0), seed=1, batch_size=2, pad_to="rank", accumulation_steps=2)
    with pytest.raises(ConfigError, match="accumulation_steps must be an int >= 1"):
        plan_epoch(ds, Topology(2, 0), seed=1, batch_size=2, accumulation_steps=0)


def test_accumulation_with_a_fixed_batch_pads_each_bucket_to_whole_optimizer_steps() -> None:
    ds = Dataset("d", {"a": list(range(13)), "b": list(range(13, 40))})
    plan = plan_epoch(ds, Topology(2, 1), seed=3, batch_size=2, accumulation_steps=3)
    assert len(plan) % 3 == 0
    assert {s.bucket: s.padded_length for s in plan.stats} == {"a": 24, "b": 36}  # multiples of 2 x 2 x 3
    assert all(len(set(plan.schedule[i:i + 3].tolist())) == 1 for i in range(0, plan.steps, 3))


def test_accumulation_one_plans_bitwise_as_before() -> None:
    ds = Dataset("d", {"a": list(range(13)), "b": list(range(13, 40))})
    a = plan_epoch(ds, Topology(2, 1), seed=3, batch_size=2)
    b = plan_epoch(ds, Topology(2, 1), seed=3, batch_size=2, accumulation_steps=1)
    assert np.array_equal(a.samples, b.samples) and np.array_equal(a.schedule, b.schedule)


def test_a_budgeted_epoch_over_the_planners_limit_is_refused_like_a_counted_one() -> None:
    from wds_pad.errors import ConfigError

    big = Dataset("big", {"a": np.arange(1000)}, repeats=2**31, cost=np.ones(1000))
    for size in (4, Budget(10.0)):
        with pytest.raises(ConfigError, match="above the planner's limit of MAX_PLANNED_ENTRIES"):
            plan_epoch(big, Topology(2, 0), seed=1, batch_size=size)
