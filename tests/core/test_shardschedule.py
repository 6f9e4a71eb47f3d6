"""Properties of core/shardschedule.py: the shards a worker reads whole, per epoch.

Each listed shard is the rank's own, listed once, in order of first use; its reads are
the worker's own reads of that shard, in walk order; the workers split the walk
round-robin; a plan without shard locality lists nothing but still counts its batches.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from wds_pad import Dataset, DroppedBucketWarning, ShardMap, Topology, plan_epoch
from wds_pad.core.shardschedule import shard_reads


def _plan(n: int, shards: int, dp: int, d: int, bs: int, window: int, seed: int, locality: str = "shard") -> Any:
    rng = np.random.default_rng(seed)
    shard = np.sort(rng.integers(0, shards, n))
    bucket = rng.integers(0, 3, n)
    ds = Dataset("d", {k: np.flatnonzero(bucket == k) for k in range(3)})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DroppedBucketWarning)
        return plan_epoch(ShardMap(ds, shard), Topology(dp, d), seed=seed, batch_size=bs, locality=locality,
                          window=window), shard


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(20, 400), shards=st.integers(1, 20), dp=st.integers(1, 4), bs=st.integers(1, 5),
       window=st.integers(1, 4), nw=st.integers(1, 3), first=st.integers(0, 5), seed=st.integers(0, 2**32 - 1))
def test_a_worker_reads_its_own_shards_once_each_in_order_of_first_use(
        n: int, shards: int, dp: int, bs: int, window: int, nw: int, first: int, seed: int) -> None:
    plan, shard = _plan(n, shards, dp, dp - 1, bs, window, seed)
    walk = range(len(plan))
    first = min(first, len(plan))
    own = set(plan.buckets.local.rank_shards(0).tolist())
    for w in range(nw):
        reads, counter = shard_reads(plan, walk, first, 7, nw, w, [shard])
        assert counter == 7 + len(plan) - first
        assert list(reads.first) == sorted(reads.first) and len(set(reads.shard.tolist())) == len(reads)
        assert reads.users.shape == (len(reads), nw)
        mine = [j for j in range(first, len(plan)) if (7 + j - first) % nw == w]
        walked = np.concatenate([plan[j].samples for j in mine]) if mine else np.zeros(0, np.int64)
        for r in range(len(reads)):
            s = int(reads.shard[r])
            assert s in own and reads.users[r, w]
            uses = reads.uses(r)
            assert np.all(shard[uses] == s)
            # the worker's reads of the shard, in walk order, but the leading ones it skips
            of_shard = walked[shard[walked] == s]
            assert np.array_equal(of_shard[int(reads.skip[r]):], uses)
            assert 0 <= reads.early[r] <= uses.size


def test_without_shard_locality_nothing_is_held_and_the_batches_still_count() -> None:
    plan, shard = _plan(200, 8, 2, 0, 4, 2, 1, locality="none")
    reads, counter = shard_reads(plan, range(len(plan)), 3, 0, 2, 0, [shard])
    assert len(reads) == 0 and counter == len(plan) - 3
    assert reads.samples.dtype == np.int64 and reads.users.shape == (0, 2)


@pytest.mark.parametrize("window", [1, 3])
def test_the_workers_together_read_every_own_shard_from_its_window(window: int) -> None:
    plan, shard = _plan(300, 12, 2, 1, 3, window, 5)
    listed = [shard_reads(plan, range(len(plan)), 0, 0, 2, w, [shard])[0] for w in range(2)]
    union = set().union(*[set(r.shard.tolist()) for r in listed])
    assert union <= set(plan.buckets.local.rank_shards(0).tolist()) and union
