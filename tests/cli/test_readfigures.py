"""cli/readfigures.py: one rank's reading cost and its node's when the node's processes
share one copy of each shard (the held shards fetched once, in blocks; a single read of a
held shard free; the rest one GET each, per process)."""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from wds_pad import Dataset, DroppedBucketWarning, ShardMap, Topology, plan_epoch
from wds_pad.cli.readfigures import figures, node_figures


def _data(n: int, shards: int, buckets: int, seed: int) -> tuple[ShardMap, np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    shard = np.sort(rng.integers(0, shards, n))
    bucket = rng.integers(0, buckets, n)
    lengths = rng.integers(100, 1000, n)
    sizes = np.bincount(shard, weights=lengths, minlength=shards).astype(np.int64)
    ds = Dataset("d", {k: np.flatnonzero(bucket == k) for k in range(buckets)})
    return ShardMap(ds, shard, shard_bytes=sizes), shard, lengths, sizes


def _node_plans(sm: ShardMap, world: int, cp: int, local: int, node: int, locality: str, **kw: Any) -> list[Any]:
    """One plan per process of ``node``; CP peers share their DP rank's plan object."""
    by_dp: dict[int, Any] = {}
    out = []
    for r in range(node * local, (node + 1) * local):
        t = Topology(world, r, cp_size=cp, local_world_size=local)
        if t.dp_rank not in by_dp:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DroppedBucketWarning)
                by_dp[t.dp_rank] = plan_epoch(sm if locality != "none" else sm.dataset, t, locality=locality, **kw)
        out.append(by_dp[t.dp_rank])
    return out


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(50, 600), shards=st.integers(2, 24), nodes=st.integers(1, 3), local=st.integers(1, 3),
       cp=st.sampled_from([1, 2]), bs=st.integers(1, 4), window=st.integers(1, 3), block=st.integers(200, 5000),
       seed=st.integers(0, 2**32 - 1))
def test_a_node_fetches_the_shards_its_ranks_read_whole_once_and_reads_the_rest_singly(
        n: int, shards: int, nodes: int, local: int, cp: int, bs: int, window: int, block: int, seed: int) -> None:
    local *= cp  # whole DP replicas on a node
    sm, shard, lengths, sizes = _data(n, shards, 3, seed)
    plans = _node_plans(sm, nodes * local, cp, local, nodes - 1, "shard", seed=seed, batch_size=bs, window=window)
    got = node_figures(plans, [shard], [lengths], [sizes], block)
    held = np.unique(np.concatenate([p.buckets.local.rank_shards(0) for p in plans]))
    assert got.processes == local and got.shards == held.size
    # every entry of a shard the node does not hold is a single GET of its process
    outside = sum(int(np.isin(shard[p.samples], held, invert=True).sum()) for p in plans)
    assert got.single == outside
    assert got.gets == int((-(-sizes[held] // block)).sum()) + outside
    alone = [figures(p, [shard], [lengths], [sizes], block) for p in plans]
    assert got.served + got.single == sum(f.single for f in alone)  # single reads: served or fetched
    assert got.alone == sum(f.gets for f in alone) >= got.gets
    # CP peers passed as separate (equal) plans give the same figures as one shared object
    copies = [plan_epoch(sm, p.topology, seed=seed, batch_size=bs, window=window, locality="shard", warn=False)
              for p in plans]
    assert node_figures(copies, [shard], [lengths], [sizes], block) == got


def test_a_node_of_one_process_is_its_rank() -> None:
    sm, shard, lengths, sizes = _data(400, 10, 3, 1)
    for locality in ("none", "shard"):
        (plan,) = _node_plans(sm, 4, 1, 1, 2, locality, seed=3, batch_size=4, window=2)
        f = figures(plan, [shard], [lengths], [sizes], 300)
        node = node_figures([plan], [shard], [lengths], [sizes], 300)
        # the node's copy holds the rank's own shards for the epoch: their reads two or more
        # windows early are served by it, the rest of its single reads are GETs
        assert (node.shards, node.alone, node.single + node.served) == (f.shards, f.gets, f.single)
        assert node.gets == f.gets - node.served
        if locality == "none":
            assert node.served == 0


def test_a_node_holding_every_shard_makes_one_fetch_per_block() -> None:
    sm, shard, lengths, sizes = _data(2000, 16, 4, 2)
    plans = _node_plans(sm, 4, 1, 4, 0, "shard", seed=5, batch_size=8, window=2)
    node = node_figures(plans, [shard], [lengths], [sizes], 1000)
    assert node.shards == 16 and node.single == 0
    assert node.gets == int((-(-sizes // 1000)).sum())
    assert node.served == sum(figures(p, [shard], [lengths], [sizes], 1000).single for p in plans) > 0
    assert node.gets_per_shard == node.gets / 16


def test_without_locality_a_node_holds_nothing_and_every_sample_is_a_get() -> None:
    sm, shard, lengths, sizes = _data(600, 8, 3, 3)
    plans = _node_plans(sm, 8, 2, 4, 1, "none", seed=5, batch_size=4)
    node = node_figures(plans, [shard], [lengths], [sizes], 1000)
    assert node.shards == 0 and node.served == 0 and node.gets_per_shard is None
    assert node.gets == node.single == node.alone == sum(int(p.samples.size) for p in plans)


@pytest.mark.parametrize(("dp", "gets", "shards"), [(8, 200, 200), (64, 1201, 25)])
def test_node_figures_of_the_object_storage_doc(dp: int, gets: int, shards: int) -> None:
    """10^5 samples in 200 shards, 20 Zipf-skewed buckets, batch 32, window 8, 8 ranks a
    node (docs/object-storage.md): the GETs of node 0 per epoch, locality shard."""
    rng = np.random.default_rng(0)
    weights = 1.0 / np.arange(1, 21) ** 1.2
    bucket = rng.choice(20, size=10**5, p=weights / weights.sum())
    shard = np.repeat(np.arange(200), 500)
    lengths = np.full(10**5, 100_000)
    sizes = np.full(200, 500 * 100_000)
    sm = ShardMap(Dataset("d", {k: np.flatnonzero(bucket == k) for k in range(20)}), shard, shard_bytes=sizes)
    plans = _node_plans(sm, dp, 1, 8, 0, "shard", seed=11, batch_size=32, window=8)
    node = node_figures(plans, [shard], [lengths], [sizes], 64 << 20)
    assert (node.gets, node.shards) == (gets, shards)
