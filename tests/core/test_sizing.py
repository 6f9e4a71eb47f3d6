"""Tests of the sizings (wds_pad/core/sizing.py, the Budget of core/budgets/budget.py) and of the
bucket table every sizing keeps, pads and drops buckets through (core/planning/buckettable.py)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from wds_pad import Budget, ConfigError, Dataset, Policy, Topology, plan_epoch
from wds_pad.core.planning.buckettable import bucket_table, padded
from wds_pad.core.planning.planrecord import Plan
from wds_pad.core.policy import MAX_PLANNED_ENTRIES, PadTo, padded_length
from wds_pad.core.sizing import Count, as_sizing


# -- the sizings -------------------------------------------------------------------------------
def test_an_int_is_a_count_and_a_sizing_is_itself() -> None:
    assert as_sizing(8) == Count(8) and as_sizing(np.int64(8)).batch_size == 8
    budget = Budget(100.0)
    assert as_sizing(budget) is budget and as_sizing(Count(3)) == Count(3)


@pytest.mark.parametrize("bad", [0, -1, True, 2.0, "8", None])
def test_a_count_that_is_not_an_int_at_least_one_is_one_config_error_naming_batch_size(bad) -> None:
    with pytest.raises(ConfigError, match=r"batch_size must be an int >= 1, got"):
        as_sizing(bad)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 64), st.integers(1, 64), st.integers(1, 8), st.sampled_from(list(PadTo)))
def test_the_pad_unit_is_one_rule_per_sizing(dp: int, bs: int, k: int, pad_to: PadTo) -> None:
    # a count: a global step (or a round of ranks) times the micro-batches of an optimizer step
    assert Count(bs).pad_unit(dp, pad_to, k) == (dp * bs if pad_to is PadTo.BATCH else dp) * k
    # a budget: a stratum, one entry per DP rank, whatever pad_to and accumulation
    assert Budget(10.0).pad_unit(dp, pad_to, k) == dp


def test_a_count_given_as_such_plans_what_its_int_plans() -> None:
    ds = Dataset("d", {"a": np.arange(37), "b": np.arange(37, 50)})
    for locality_free in (Topology(4, 1), Topology(3, 2)):
        a = plan_epoch(ds, locality_free, seed=5, epoch=2, batch_size=3)
        b = plan_epoch(ds, locality_free, seed=5, epoch=2, batch_size=Count(3))
        assert np.array_equal(a.samples, b.samples) and np.array_equal(a.pad, b.pad)
        assert a.stats == b.stats and a.sizing == Count(3)


def test_a_plan_names_its_sizing() -> None:
    ds = Dataset("d", {"a": np.arange(40)}, cost=np.arange(1, 41, dtype=np.float64))
    budget = Budget(60.0)
    plan = plan_epoch(ds, Topology(2, 0), seed=1, batch_size=budget)
    assert plan.sizing is budget
    assert isinstance(plan_epoch(ds, Topology(2, 0), seed=1, batch_size=4), Plan)


# -- the bucket table --------------------------------------------------------------------------
def _datasets(sizes: list[int], repeats: int) -> list[Dataset]:
    start, buckets = 0, {}
    for j, n in enumerate(sizes):
        buckets[f"b{j}"] = np.arange(start, start + n)
        start += n
    return [Dataset("d", buckets, repeats=repeats)]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 60), min_size=1, max_size=6), st.integers(0, 2), st.integers(1, 24),
       st.sampled_from([Policy.CYCLIC, Policy.DROP, Policy.NONE]), st.booleans())
def test_the_bucket_table_keeps_pads_and_drops_each_bucket_by_the_pad_rule(
        sizes: list[int], repeats: int, unit: int, policy: Policy, oversubscribe: bool) -> None:
    dss = _datasets(sizes, repeats)
    measured = []

    def measure(ds, key, ids, n, passes):
        measured.append(n)
        return padded(unit, policy, oversubscribe, lambda length: Count(unit).steps(length, 1))(ds, key, ids, n, passes)

    got = bucket_table(dss, measure, epoch=0, dp=1, batch=unit, unit=unit, oversubscribe=oversubscribe, size="x")
    assert 0 not in measured  # an empty bucket never reaches the arithmetic
    passes = 1 + repeats
    kept = [(st.dataset, st.bucket) for st in got.stats if st.padded_length]
    assert [(dss[k.di].name, k.key) for k in got.kept] == kept == [("d", key) for _, key in got.table]
    for st, n in zip(got.stats, sizes):
        m = n * passes
        want = padded_length(m, unit, policy, oversubscribe) if n else 0
        assert st.padded_length == want and st.length == m
        assert st.padded_copies == max(want - m, 0) and st.truncated == (max(m - want, 0) if n else 0)
        assert st.dropped == (n > 0 and want == 0) and st.steps == -(-want // unit)
    assert got.dropped_samples == sum(n for n, st in zip(sizes, got.stats) if st.dropped)
    assert len(got.dropped) == sum(st.dropped for st in got.stats) and got.total_samples == sum(sizes)


def test_the_size_guard_refuses_a_bucket_before_it_is_measured() -> None:
    class Huge:  # a bucket of 2**40 ids (nothing allocated: only .size is read before measuring)
        size = MAX_PLANNED_ENTRIES

    ds = Dataset("d", {"a": np.arange(3)}, repeats=1)
    object.__setattr__(ds, "buckets", {"a": Huge()})

    def measure(*args):
        raise AssertionError("measured a bucket past the limit")

    with pytest.raises(ConfigError, match=r"bucket 'a' would hold \d+ entries per epoch"):
        bucket_table([ds], measure, epoch=0, dp=1, batch=1, unit=1, oversubscribe=False, size="1")


@pytest.mark.parametrize("sizing", [4, Budget(50.0)], ids=["count", "budget"])
def test_every_sizing_keeps_and_drops_through_the_same_table(sizing) -> None:
    ds = Dataset("d", {"big": np.arange(30), "tiny": np.arange(30, 31)}, cost=np.ones(31))
    with pytest.warns(Warning, match=r"1 bucket\(s\) smaller than one global step were dropped"):
        plan = plan_epoch(ds, Topology(4, 0), seed=0, batch_size=sizing, policy="drop")
    tiny = next(s for s in plan.stats if s.bucket == "tiny")
    assert tiny.dropped and tiny.padded_length == 0 and tiny.truncated == 1
    assert [key for _, key in plan.bucket_table] == ["big"]


def test_each_sizing_names_itself_for_the_summary_line_and_batched() -> None:
    from wds_pad import Pack
    assert Count(64).summary() == "batch 64"
    assert Budget(8192, "sum").summary() == "budget 8192 (sum)"
    assert Pack(4096, packs=2).summary() == "pack 4096 x 2"
    assert as_sizing(64) == Count(64) != Budget(64)
