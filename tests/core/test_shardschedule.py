"""Properties of core/local/shardschedule.py: the shards a worker reads whole, per epoch.

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
from wds_pad.core.local.shardschedule import shard_reads


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


# -- the node-wide table: every read of every rank of a node --------------------------------

@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(20, 300), shards=st.integers(1, 16), dp=st.integers(1, 4), cp=st.integers(1, 2),
       bs=st.integers(1, 4), window=st.integers(1, 3), nw=st.integers(1, 3), first=st.integers(0, 4),
       counter=st.integers(0, 5), seed=st.integers(0, 2**32 - 1))
def test_the_node_table_lists_every_read_of_every_rank_of_the_node(
        n: int, shards: int, dp: int, cp: int, bs: int, window: int, nw: int, first: int, counter: int,
        seed: int) -> None:
    """Rows are the shards any DP rank of the node reads from ``first`` on, each once; a
    row's steps are exactly the walk positions where one of them reads it; its users are
    the (local rank, worker) processes that do (CP peers included); ``mine`` is one
    process's own reads in walk order; ``held`` is what some rank's schedule reads whole."""
    from wds_pad.core.local.shardschedule import node_uses

    plans = [_plan(n, shards, dp, d, bs, window, seed) for d in range(dp)]
    shard = plans[0][1]
    first = min(first, len(plans[0][0]))
    local = [[d * cp + c for c in range(cp)] for d in range(dp)]  # one node: every rank
    me = (dp - 1, (dp - 1) * cp + cp - 1, nw - 1)
    table = node_uses([p for p, _ in plans], local, first, counter, nw, me, [shard])
    reads: dict[int, set[int]] = {}
    users: dict[int, set[int]] = {}
    mine: dict[int, list[int]] = {}
    for d, (plan, _) in enumerate(plans):
        for j in range(first, len(plan)):
            w = (counter + j - first) % nw
            for s in shard[plan[j].samples].tolist():
                reads.setdefault(s, set()).add(j)
                users.setdefault(s, set()).update(r * nw + w for r in local[d])
                if d == me[0] and w == me[2]:
                    mine.setdefault(s, []).append(j)
    assert sorted(table.shard.tolist()) == sorted(reads) and np.all(table.dataset == 0)
    assert table.length == len(plans[0][0])
    held = set()
    for plan, _ in plans:
        held |= set(shard_reads(plan, range(len(plan)), first, 0, 1, 0, [shard])[0].shard.tolist())
    for r in range(len(table)):
        s = int(table.shard[r])
        assert table.uses(r).tolist() == sorted(reads[s])
        assert set(np.flatnonzero(table.users[r]).tolist()) == users[s]
        assert table.mine(r).tolist() == mine.get(s, [])
        assert bool(table.held[r]) == (s in held)
