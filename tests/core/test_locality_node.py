"""``locality="node"``: shards dealt to nodes for good, a node's ranks reading them together.

Hypothesis properties of the invariants every locality keeps (equal batches, lockstep
buckets, CP peers identical, each entry once) over random buckets, node layouts and
policies, plus what is particular to nodes: a node keeps its shards every epoch, its
ranks read only its shards and the few other nodes' samples that keep the buckets' shares
equal, which come from the same shards every epoch; and an epoch resumed on another
number of nodes reads every entry left exactly once.
"""

from __future__ import annotations

import warnings
from collections import Counter
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from wds_pad import Budget, ConfigError, Dataset, DroppedBucketWarning, ShardMap, Topology, plan_epoch
from wds_pad.core.elastic.remainder import Segment, plan_remainder

PROPERTY = settings(max_examples=150, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _source(seed: int, sizes: list[int], shards: int, repeats: int = 0) -> tuple[ShardMap, dict[Any, Any]]:
    rng = np.random.default_rng(seed)
    total = sum(sizes)
    ids = rng.permutation(total)
    buckets, at = {}, 0
    for b, n in enumerate(sizes):
        buckets[b] = ids[at:at + n]
        at += n
    return ShardMap(Dataset("d", buckets, repeats=repeats), shard=rng.integers(0, shards, max(total, 1))), buckets


def _plans(src: ShardMap, nodes: int, local: int, cp: int, **kw: Any) -> list[Any]:
    world = nodes * local
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DroppedBucketWarning)
        return [plan_epoch(src, Topology(world, r, cp_size=cp, local_world_size=local), locality="node", **kw)
                for r in range(world)]


@PROPERTY
@given(seed=st.integers(0, 2**32), sizes=st.lists(st.integers(0, 60), min_size=1, max_size=4),
       nodes=st.integers(1, 3), local=st.sampled_from([1, 2, 4]), cp=st.sampled_from([1, 2]),
       policy=st.sampled_from(["cyclic", "drop", "none"]), bs=st.integers(1, 4), epoch=st.integers(0, 3),
       repeats=st.integers(0, 1))
def test_node_locality_keeps_the_invariants_of_every_locality(
        seed: int, sizes: list[int], nodes: int, local: int, cp: int, policy: str, bs: int, epoch: int,
        repeats: int) -> None:
    assume(not (local % cp and cp % local) and (nodes * local) % cp == 0)
    src, buckets = _source(seed, sizes, 12, repeats)
    plans = _plans(src, nodes, local, cp, seed=5, epoch=epoch, batch_size=bs, policy=policy, window=2)
    if policy != "none":
        assert len({len(p) for p in plans}) == 1
        assert all([b.step for b in p] == [b.step for b in plans[0]] for p in plans)
    seen: Counter[int] = Counter()
    for r, p in enumerate(plans):
        if r % cp:
            assert [b.samples.tolist() for b in p] == [b.samples.tolist() for b in plans[r - r % cp]]
            continue
        for b in p:
            seen.update(b.samples[~b.pad].tolist())
    kept = {s.bucket for s in plans[0].stats if not s.dropped}
    for key, ids in buckets.items():
        for i in ids.tolist():
            assert seen[i] <= 1 + repeats if policy == "drop" or key not in kept else seen[i] == 1 + repeats


def test_a_node_keeps_its_shards_every_epoch_and_reads_others_from_the_same_few() -> None:
    rng = np.random.default_rng(0)
    n, shards = 20000, 40
    shard = np.sort(rng.integers(0, shards, n))
    group = rng.zipf(1.3, n) % 8
    src = ShardMap(Dataset("d", {b: np.flatnonzero(group == b) for b in range(8)}), shard=shard)
    own, other = [], []
    for epoch in range(3):
        plans = _plans(src, 4, 2, 1, seed=9, epoch=epoch, batch_size=16, window=4)
        mine = set(plans[0].buckets.local.rank_shards(0).tolist())
        assert mine == set(plans[1].buckets.local.rank_shards(0).tolist())  # one node, one set
        read = shard[np.concatenate([p.samples[~p.pad] for p in plans[:2]])]
        outside = ~np.isin(read, list(mine))
        own.append(mine)
        other.append(set(read[outside].tolist()))
        assert outside.mean() <= 0.05                    # a node reads its own shards but for a few samples
    assert own[0] == own[1] == own[2]
    assert len(other[1] - other[0]) <= 1 and len(other[2] - other[0]) <= 1  # the same few, epoch after epoch


def test_node_locality_needs_a_node_layout_that_holds_whole_replicas() -> None:
    src, _ = _source(1, [10, 10], 4)
    with pytest.raises(ConfigError, match="has no node layout"):
        plan_epoch(src, Topology(4, 0), seed=1, batch_size=2, locality="node")
    with pytest.raises(ConfigError, match="do not divide one another"):
        plan_epoch(src, Topology(12, 0, cp_size=3, local_world_size=4), seed=1, batch_size=2, locality="node")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32), sizes=st.lists(st.integers(0, 50), min_size=1, max_size=3),
       layouts=st.lists(st.tuples(st.integers(1, 3), st.sampled_from([1, 2])), min_size=2, max_size=3),
       data=st.data())
def test_an_epoch_resumed_on_other_nodes_reads_each_entry_left_once(
        seed: int, sizes: list[int], layouts: list[tuple[int, int]], data: Any) -> None:
    src, _ = _source(seed, sizes, 9)
    kw = dict(seed=2, epoch=0, batch_size=2, policy="cyclic", window=2, oversubscribe=True)
    nodes, local = layouts[0]
    plans = _plans(src, nodes, local, 1, **kw)
    want: Counter[int] = Counter()
    for p in plans:
        for b in p:
            want.update(b.samples[~b.pad].tolist())
    got: Counter[int] = Counter()
    segments: list[Segment] = []
    for (prev_nodes, prev_local), (nodes, local) in zip(layouts, layouts[1:]):
        steps = data.draw(st.integers(0, len(plans[0])))
        for p in plans:
            for i in range(steps):
                got.update(p[i].samples[~p[i].pad].tolist())
        segments.append(Segment(prev_nodes * prev_local, steps=steps, node_ranks=prev_local))
        world = nodes * local
        rest = [plan_remainder(src, Topology(world, r, local_world_size=local), segments, locality="node", **kw)
                for r in range(world)]
        assert len({x.fingerprint for x in rest}) == 1 and len({len(x.plan) for x in rest}) == 1
        plans = [x.plan for x in rest]
    for p in plans:
        for b in p:
            got.update(b.samples[~b.pad].tolist())
    assert got == want


def _foreign_shards(plans: list[Any], shard: np.ndarray, mine: set[int], every_node_needs: set[Any]) -> set[int]:
    """Other nodes' shards a node's plans read: real entries, and padded copies of the
    buckets every node has real entries of."""
    out: set[int] = set()
    for p in plans:
        for b in p:
            keep = ~b.pad | (b.bucket in every_node_needs)
            out.update(int(s) for s in shard[b.samples[keep]].tolist() if int(s) not in mine)
    return out


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32), sizes=st.lists(st.integers(0, 120), min_size=1, max_size=4),
       shards=st.integers(4, 40), nodes=st.integers(2, 4), local=st.sampled_from([1, 2, 4]),
       policy=st.sampled_from(["cyclic", "drop"]), sizing=st.sampled_from(["count", "budget"]),
       window=st.integers(1, 4), skew=st.booleans())
def test_later_epochs_read_no_other_node_shard_epoch_0_did_not(
        seed: int, sizes: list[int], shards: int, nodes: int, local: int, policy: str, sizing: str,
        window: int, skew: bool) -> None:
    rng = np.random.default_rng(seed)
    total = max(sum(sizes), 1)
    # skewed: a bucket's samples crowd a few shards (a dataset written bucket by bucket)
    shard = np.sort(rng.integers(0, shards, total)) if skew else rng.integers(0, shards, total)
    ids, at, buckets = rng.permutation(total) if not skew else np.arange(total), 0, {}
    for b, n in enumerate(sizes):
        buckets[b] = ids[at:at + n]
        at += n
    src = ShardMap(Dataset("d", buckets, cost=rng.integers(1, 9, total)), shard=shard)
    size: Any = 3 if sizing == "count" else Budget(12)
    world = nodes * local
    per_epoch = [_plans(src, nodes, local, 1, seed=seed % 1000, epoch=e, batch_size=size, policy=policy,
                        window=window, oversubscribe=True) for e in range(3)]
    every_node_needs = {s.bucket for s in per_epoch[0][0].stats
                        if not s.dropped and min(s.samples, s.length) >= world}
    for n in range(nodes):
        ranks = range(n * local, (n + 1) * local)
        mine = set(per_epoch[0][n * local].buckets.local.rank_shards(0).tolist())
        first = _foreign_shards([per_epoch[0][r] for r in ranks], shard, mine, every_node_needs)
        for later in per_epoch[1:]:
            assert set(later[n * local].buckets.local.rank_shards(0).tolist()) == mine
            assert _foreign_shards([later[r] for r in ranks], shard, mine, every_node_needs) <= first
