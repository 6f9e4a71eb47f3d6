"""Properties of core/local/shardsplit.py: the shard-level deal and each worker's plan.

Equal shard counts per DP rank, every shard once unpadded, padded copies cyclically
from the front of the shuffled order, each worker's target the most any rank's same
worker holds; pinned bitwise so split_by_node orders stay the same across versions.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from wds_pad import ConfigError, Topology
from wds_pad.core.seed import derive_rng
from wds_pad.core.local.shardsplit import WorkerPlan, deal_shards, worker_plan


@settings(max_examples=200, deadline=None)
@given(n=st.integers(0, 40), dp=st.integers(1, 12), seed=st.integers(0, 2**63), epoch=st.integers(0, 50))
def test_the_deal_pads_cyclically_to_equal_counts(n: int, dp: int, seed: int, epoch: int) -> None:
    shard, padded = deal_shards(n, seed, epoch, dp)
    k = -(-n // dp)
    assert shard.shape == padded.shape == (dp, k) and shard.dtype == np.int64 and padded.dtype == bool
    assert sorted(shard[~padded].tolist()) == list(range(n))  # every shard once, unpadded
    assert int(padded.sum()) == (-n) % dp
    for row in shard:
        assert len(set(row.tolist())) == row.size  # no rank holds a shard twice
    # global position p = d + j * dp: the shuffled order, then its own prefix again
    flat = shard.T.ravel()
    if n:
        order = derive_rng(seed, epoch, "shards").permutation(n)
        assert flat.tolist() == [int(order[p % n]) for p in range(k * dp)]


def test_the_deal_is_pinned() -> None:
    shard, padded = deal_shards(7, 11, 3, 3)
    assert shard.tolist() == [[5, 4, 0], [1, 3, 5], [2, 6, 1]]
    assert padded.tolist() == [[False, False, False], [False, False, True], [False, False, True]]


@pytest.mark.parametrize("num_workers", [1, 2, 3])
def test_a_workers_target_is_the_most_any_rank_holds(num_workers: int) -> None:
    counts = {f"/d/s{i}.tar": 3 + (i * 7) % 5 for i in range(10)}
    for w in range(num_workers):
        plans = [worker_plan(counts, 5, 1, Topology(world_size=3, rank=r), w, num_workers) for r in range(3)]
        held = [sum(counts[u] for u, _ in p.shards) for p in plans]
        assert {p.target for p in plans} == {max(held)}
        for p in plans:
            assert p.cycle == tuple(u for u, _ in p.shards)
    # CP peers (same dp_rank) get the same plan
    cp = [worker_plan(counts, 5, 1, Topology(world_size=4, rank=r, cp_size=2), 0, 1) for r in (2, 3)]
    assert cp[0] == cp[1]


def test_a_worker_without_shards_wraps_over_every_shard_and_the_order_is_the_callers() -> None:
    counts = {"/d/b.tar": 2, "/d/a.tar": 4}
    plan = worker_plan(counts, 1, 0, Topology(world_size=1, rank=0), 2, 3)
    assert plan.shards == () and plan.cycle == ("/d/b.tar", "/d/a.tar") and plan.target == 0
    ordered = worker_plan(counts, 1, 0, Topology(world_size=1, rank=0), 0, 1)
    assert ordered == worker_plan(counts, 1, 0, Topology(world_size=1, rank=0), 0, 1, order=["/d/a.tar", "/d/b.tar"])
    assert plan.shard_at(0) == ("/d/b.tar", True)
    with pytest.raises(ConfigError, match="target"):
        WorkerPlan((), (), -1)
    with pytest.raises(ConfigError, match="nothing to wrap over"):
        WorkerPlan((), (), 0).shard_at(0)
