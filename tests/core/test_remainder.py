"""Properties of core/elastic/remainder.py: an epoch resumed on any layout, at any step.

Over random bucket sizes, batch sizes, DP sizes (1-8, CP 1-2), save steps, both
localities and every padding policy: what the earlier layouts consumed plus the
remainder's real entries is the epoch's real entries, each exactly once; every new rank
gets the same batch count (lockstep policies), all ranks take the same bucket at the same
step, CP peers get identical batches, and repeated changes compose.
"""

from __future__ import annotations

import warnings
from collections import Counter
from typing import Any

import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from wds_pad.core.local.locality import ShardMap
from wds_pad.core.dataset import Dataset, as_datasets
from wds_pad.core.planning.plan import plan_epoch
from wds_pad.core.elastic.remainder import Segment, plan_remainder
from wds_pad.core.topology import Topology
from wds_pad.errors import StateError, StateMismatchError


def _data(buckets: list[int], shards: int, locality: str) -> Any:
    ids = np.arange(sum(buckets))
    bounds = np.cumsum([0] + buckets)
    data = {f"b{i}": ids[bounds[i]:bounds[i + 1]] for i in range(len(buckets))}
    if locality == "none":
        return data
    shard = (np.arange(ids.size) * 7919) % shards  # each bucket spread over the shards
    return ShardMap(_dataset(data), shard=shard, shard_bytes=np.bincount(shard, minlength=shards) + 1)


def _dataset(data: dict[str, np.ndarray]) -> Dataset:
    return as_datasets(data)[0]


def _real(plan: Any, batches: Any) -> Counter[int]:
    return Counter(int(x) for b in batches for x, pad in zip(b.samples, b.pad) if not pad)


def _plans(data: Any, dp: int, segments: list[Segment], cp: int = 1, **kw: Any) -> list[Any]:
    """The plan of every rank (world dp * cp) after ``segments`` (the epoch's own plan if none)."""
    out = []
    for r in range(dp * cp):
        topo = Topology(dp * cp, r, cp_size=cp)
        if segments:
            out.append(plan_remainder(data, topo, segments, **kw).plan)
        else:
            out.append(plan_epoch(data, topo, warn=False, **kw))
    return out


def _check_layout(plans: list[Any], cp: int, lockstep: bool) -> None:
    by_dp = plans[::cp]
    if lockstep:
        assert len({len(p) for p in by_dp}) == 1, "every DP rank gets the same batch count"
        for i in range(len(by_dp[0])):
            assert len({(p[i].step, p[i].dataset, p[i].bucket) for p in by_dp}) == 1, "lockstep"
    for r, p in enumerate(plans):  # CP peers are identical
        peer = plans[r - r % cp]
        assert [b.samples.tolist() for b in p] == [b.samples.tolist() for b in peer]
        assert [b.pad.tolist() for b in p] == [b.pad.tolist() for b in peer]


@settings(max_examples=120, deadline=None)
@given(buckets=st.lists(st.integers(0, 50), min_size=1, max_size=5), bs=st.integers(1, 4),
       layouts=st.lists(st.tuples(st.integers(1, 8), st.floats(0, 1)), min_size=2, max_size=3),
       cp=st.integers(1, 2), locality=st.sampled_from(["none", "shard"]),
       policy=st.sampled_from(["cyclic", "drop", "none"]), pad_to=st.sampled_from(["batch", "rank"]),
       data_seed=st.integers(0, 3))
def test_consumed_and_resumed_are_the_epoch_exactly_once(buckets: list[int], bs: int, layouts: list[Any],
                                                        cp: int, locality: str, policy: str, pad_to: str,
                                                        data_seed: int) -> None:
    data = _data(buckets, 5, locality)
    kw = dict(seed=data_seed, epoch=0, batch_size=bs, policy=policy, pad_to=pad_to, locality=locality,
              oversubscribe=policy == "cyclic", window=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first = _plans(data, layouts[0][0], [], **kw)
    epoch = _real(None, (b for p in first for b in p))
    consumed: Counter[int] = Counter()
    segments: list[Segment] = []
    lockstep = policy != "none"
    for (dp, frac), (new_dp, _) in zip(layouts, layouts[1:]):
        plans = _plans(data, dp, segments, **kw)
        if lockstep:
            steps = round(frac * len(plans[0]))
            seg = Segment(dp, steps=steps)
            taken = [steps] * dp
        else:  # ranks at different positions
            taken = [round(frac * len(p) * (1 - 0.3 * (d % 2))) for d, p in enumerate(plans)]
            seg = Segment(dp, positions=tuple(taken))
        consumed += _real(None, (b for p, t in zip(plans, taken) for b in list(p)[:t]))
        segments.append(seg)
        news = _plans(data, new_dp, segments, cp=cp, **kw)
        _check_layout(news, cp, lockstep)
        rest = _real(None, (b for p in news[::cp] for b in p))
        assert consumed + rest == epoch, "consumed + resumed = the epoch's samples, none twice"
        event(f"segments {len(segments)}")
    fps = {plan_remainder(data, Topology(layouts[-1][0], r), segments, **kw).fingerprint
           for r in range(layouts[-1][0])}
    assert len(fps) == 1


RANK_CHANGES = [(4, 3, 2), (4, 5, 3), (2, 7, 4), (3, 4, 1)]  # (old ranks, steps, new ranks)


@pytest.mark.parametrize("locality", ["none", "shard"])
@pytest.mark.parametrize("old,steps,new", RANK_CHANGES)
def test_rank_changes_mid_epoch_on_skewed_buckets_resume_exactly(old: int, steps: int, new: int, locality: str) -> None:
    """8 shards in 4 skewed buckets, batch 2, cyclic: each mid-epoch change resumes exactly."""
    sizes = [40, 16, 6, 2]
    ids = np.arange(sum(sizes))
    bounds = np.cumsum([0] + sizes)
    data: Any = {f"b{i}": ids[bounds[i]:bounds[i + 1]] for i in range(4)}
    if locality == "shard":
        shard = np.arange(ids.size) * 8 // ids.size
        data = ShardMap(_dataset(data), shard=shard)
    kw = dict(seed=3, epoch=0, batch_size=2, policy="cyclic", locality=locality, oversubscribe=True)
    olds = _plans(data, old, [], **kw)
    assert 0 < steps < len(olds[0])
    epoch = _real(None, (b for p in olds for b in p))
    consumed = _real(None, (b for p in olds for b in list(p)[:steps]))
    news = _plans(data, new, [Segment(old, steps=steps)], **kw)
    _check_layout(news, 1, True)
    assert consumed + _real(None, (b for p in news for b in p)) == epoch


def test_refusals_name_what_is_wrong() -> None:
    data = {"a": np.arange(20)}
    kw = dict(seed=1, epoch=0, batch_size=2, policy="cyclic")
    with pytest.raises(StateMismatchError, match="position 99 is past the end of epoch 0 on dp_size 2"):
        plan_remainder(data, Topology(1, 0), [Segment(2, steps=99)], **kw)
    with pytest.raises(StateError, match="needs one per DP rank"):
        Segment(3, positions=(1, 2))
    with pytest.raises(StateMismatchError, match="of dp_rank 1 is past the end"):
        plan_remainder(data, Topology(1, 0), [Segment(2, positions=(1, 50))], **{**kw, "policy": "none"})


@settings(max_examples=60, deadline=None)
@given(buckets=st.lists(st.integers(1, 60), min_size=1, max_size=4), bs=st.integers(1, 3),
       old=st.integers(1, 6), new=st.integers(1, 6), acc=st.integers(1, 3), frac=st.floats(0, 1),
       locality=st.sampled_from(["none", "shard"]))
def test_remainder_flags_oversubscribed_buckets_by_the_unit_with_accumulation(
        buckets: list[int], bs: int, old: int, new: int, acc: int, frac: float, locality: str) -> None:
    """A remainder's bucket is flagged oversubscribed exactly when it was padded up to one whole
    pad unit from fewer entries, the unit counting the accumulation steps (as a fresh plan's)."""
    data = _data(buckets, 5, locality)
    kw = dict(seed=0, epoch=0, batch_size=bs, policy="cyclic", locality=locality, oversubscribe=True,
              window=2, accumulation_steps=acc)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first = plan_epoch(data, Topology(old, 0), **kw)
        seg = Segment(old, steps=round(frac * len(first)))
        plan = plan_remainder(data, Topology(new, 0), [seg], **kw).plan
    unit = new * bs * acc  # pad_to="batch": whole optimizer steps of every rank
    assert plan.pad_unit == unit
    for s in plan.stats:
        want = 0 < s.length < unit <= s.padded_length
        event(f"oversubscribed {want}")
        assert s.oversubscribed == want, (s, unit)
