"""Properties of locality="shard" beyond invariants 1-7 (those are in test_plan.py):
the deal, the windows, the minimal foreign rebalance, and the refusals."""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from wds_pad import ConfigError, Dataset, DroppedBucketWarning, Topology, plan_epoch
from wds_pad.core.locality import ShardMap

PROPERTY = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def cases(draw: Any) -> dict[str, Any]:
    n = draw(st.integers(1, 600))
    shards = draw(st.integers(1, 30))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    shard = np.sort(rng.integers(0, shards, n)) if draw(st.booleans()) else rng.integers(0, shards, n)
    nb = draw(st.integers(1, 5))
    bucket = rng.integers(0, nb, n)
    ds = Dataset("d", {k: np.flatnonzero(bucket == k) for k in range(nb)}, repeats=draw(st.integers(0, 2)))
    sizes = rng.integers(1, 10**6, shards) if draw(st.booleans()) else None
    return dict(sm=ShardMap(ds, shard, shard_bytes=sizes), shard=shard, dp=draw(st.integers(1, 12)),
                bs=draw(st.integers(1, 6)), seed=draw(st.integers(0, 2**64 - 1)), epoch=draw(st.integers(0, 3)),
                window=draw(st.integers(1, 5)), policy=draw(st.sampled_from(["cyclic", "drop", "none"])),
                oversubscribe=draw(st.booleans()), sizes=sizes)


def plans(c: dict[str, Any], epoch: int | None = None) -> list[Any]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DroppedBucketWarning)
        return [plan_epoch(c["sm"], Topology(c["dp"], d), seed=c["seed"], batch_size=c["bs"],
                           epoch=c["epoch"] if epoch is None else epoch, policy=c["policy"],
                           oversubscribe=c["oversubscribe"], locality="shard", window=c["window"])
                for d in range(c["dp"])]


def owned_entries(plan: Any, d: int, shard: np.ndarray) -> tuple[int, int, int]:
    """(entries of rank d read from its own shards, foreign entries, unpadded entries)."""
    mine = set(plan.buckets.local.rank_shards(0, d).tolist())
    real = ~plan.pad
    from_mine = np.isin(shard[plan.samples[real]], list(mine))
    return int(from_mine.sum()), int((~from_mine).sum()), int(real.sum())


@PROPERTY
@given(cases())
def test_every_shard_is_dealt_to_exactly_one_rank_balanced_by_bytes(c: dict[str, Any]) -> None:
    ps = plans(c)
    dealt = [p.buckets.local.rank_shards(0, d) for d, p in enumerate(ps)]
    assert all(np.array_equal(dealt[0], ps[0].buckets.local.rank_shards(0, 0)) for _ in ps)
    allsh = np.concatenate(dealt)
    nshards = ps[0].buckets.local.dealt[0].visit.size
    assert sorted(allsh.tolist()) == list(range(nshards))
    weight = c["sizes"] if c["sizes"] is not None else np.bincount(c["shard"], minlength=nshards)
    if weight.sum() > 0:
        per_rank = np.asarray([weight[s].sum() for s in dealt])
        assert np.all(np.abs(per_rank - weight.sum() / c["dp"]) <= weight.max())


@PROPERTY
@given(cases())
def test_non_foreign_samples_come_from_the_ranks_own_shards_and_foreign_is_minimal(c: dict[str, Any]) -> None:
    ps = plans(c)
    shard = c["shard"]
    dp = c["dp"]
    total_foreign = 0
    for d, p in enumerate(ps):
        local = p.buckets.local
        own_shards = local.rank_shards(0, d)
        expect = 0
        for b, st_ in zip(local.buckets, [s for s in p.stats if s.padded_length]):
            ids = p.buckets.ids[local.buckets.index(b)]
            passes = st_.length // st_.samples
            own = int(np.isin(shard[np.asarray(ids)], own_shards).sum()) * passes
            need = len(range(d, min(st_.length, st_.padded_length), dp))
            expect += max(0, need - own)  # the fewest foreign entries that fill the share
        _, foreign, _ = owned_entries(p, d, shard)
        assert foreign == expect == local.foreign(d)
        total_foreign += foreign
    # each shard's non-foreign entries go to one rank only
    owner: dict[int, int] = {}
    for d, p in enumerate(ps):
        mine = set(p.buckets.local.rank_shards(0, d).tolist())
        for s in set(shard[p.samples[~p.pad]].tolist()) & mine:
            assert owner.setdefault(s, d) == d


@PROPERTY
@given(cases())
def test_a_rank_reads_each_window_at_its_steps_but_for_the_fewest_spilled_entries(c: dict[str, Any]) -> None:
    """Entries taken at the steps of window w come from w's shards, except exactly the
    spill: per window, the entries its shards cannot supply (sum of max(0, q - pool))."""
    ps = plans(c)
    d = c["seed"] % c["dp"]
    p = ps[d]
    local = p.buckets.local
    order = local.rank_shards(0, d)
    win = {int(s): i // c["window"] for i, s in enumerate(order.tolist())}
    steps = np.repeat(p.batch_step, np.diff(p.offsets))
    shard_win = np.asarray([win.get(int(s), -1) for s in c["shard"][p.samples].tolist()], np.int64)
    own = (~p.pad) & (shard_win >= 0)
    step_win = local.window_of_step(0, steps, d)
    outside = int((own & (shard_win != step_win)).sum())
    spilled = sum(int((bk.q - bk.use)[bk.rank_of == d].sum()) for bk in local.buckets)
    assert outside == spilled
    for bk in local.buckets:  # a window never takes more than its steps ask, nor than it holds
        assert np.all(bk.use <= bk.q) and np.all(bk.use <= bk.pool)
        assert np.all((bk.use == bk.q) | (bk.use == bk.pool))


def test_the_assignment_changes_between_epochs() -> None:
    sm = ShardMap(Dataset("d", {0: np.arange(2000)}), np.arange(2000) // 20)
    deal = [tuple(plan_epoch(sm, Topology(4, 0), seed=1, epoch=e, batch_size=4, locality="shard")
                  .buckets.local.rank_shards(0).tolist()) for e in range(4)]
    assert len(set(deal)) == 4
    assert all(len(x) == 25 for x in deal)


def test_foreign_samples_stay_under_5_percent_at_dp_8_on_skewed_buckets() -> None:
    """The issue's figure: 10^5 samples, 200 shards, 20 skewed buckets, dp 8."""
    rng = np.random.default_rng(0)
    n, shards = 10**5, 200
    weights = 1.0 / np.arange(1, 21) ** 1.2
    bucket = rng.choice(20, size=n, p=weights / weights.sum())
    shard = np.repeat(np.arange(shards), n // shards)
    sm = ShardMap(Dataset("d", {k: np.flatnonzero(bucket == k) for k in range(20)}), shard)
    for d in (0, 3, 7):
        p = plan_epoch(sm, Topology(8, d), seed=11, batch_size=32, locality="shard")
        assert p.buckets.local.foreign() <= 0.05 * int((~p.pad).sum())


@pytest.mark.parametrize("kwargs, match", [
    (dict(locality="random"), "unknown locality 'random'; expected one of: none, shard"),
    (dict(locality="shard", window=0), "window must be an int >= 1"),
    (dict(locality="shard"), "ShardMap"),
])
def test_refusals_name_the_fix(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        plan_epoch(Dataset("d", {0: np.arange(10)}), Topology(2, 0), seed=0, batch_size=2, **kwargs)


def test_a_shard_map_must_cover_every_sample_id() -> None:
    with pytest.raises(ConfigError, match="one shard number per sample id"):
        ShardMap(Dataset("d", {0: np.arange(10)}), np.zeros(5, np.int64))
