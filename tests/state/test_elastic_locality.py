"""Elastic resume (``load_state_dict(state, allow_elastic=True)``) with locality="shard".

An elastic resume is exact because a bucket's padded global order is the same on every
DP layout, so what the job consumed of it is a prefix (state/elastic.py). With
locality="shard" that order depends on the layout: the shards are dealt to the DP ranks,
and a rank's entries come from its own shards, so the prefix consumed on dp_size 4 is
other samples than the same prefix on dp_size 2. Mid-epoch, such a state is refused
before anything is restored, naming the fix; at an epoch boundary it maps onto any
layout, and on the saved layout it resumes exactly, as with locality="none".
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from wds_pad.core.topology import Topology
from wds_pad.errors import TopologyMismatchError
from wds_pad.index.format import Index
from wds_pad.state.elastic import elastic_view
from wds_pad.stream.dataset import BucketedWebDataset

from data_helpers import image_index, make_dataset

pytestmark = pytest.mark.filterwarnings("ignore::wds_pad.errors.DroppedBucketWarning")


@pytest.fixture(scope="module")
def index(tmp_path_factory: pytest.TempPathFactory) -> Index:
    return image_index(tmp_path_factory.mktemp("shards"), samples=240, shards=12, seed=3)


def make_ds(index: Index, world: int, rank: int, **kw: Any) -> BucketedWebDataset:
    return make_dataset(index, quiet=True, **{"seed": 5, "check_agreement": False, "locality": "shard",
                                               "window": 2, "topology": Topology(world, rank), **kw})


def keys(batches: Any) -> Counter[str]:
    return Counter(s["__key__"] for b in batches for s in b)


def consume(index: Index, world: int, steps: int) -> tuple[list[Any], list[dict[str, Any]]]:
    """Every rank of ``world`` takes ``steps`` batches of epoch 0; (batches, states)."""
    batches, states = [], []
    for r in range(world):
        ds = make_ds(index, world, r)
        it = iter(ds)
        batches += [next(it) for _ in range(steps)]
        states.append(ds.state_dict())
    return batches, states


def batch_keys(batches: Any) -> list[tuple[tuple[str, bool], ...]]:
    return [tuple((s["__key__"], bool(s["__pad__"])) for s in b) for b in batches]


@pytest.mark.parametrize("old,new", [(4, 2), (2, 4), (4, 1), (3, 2)])
def test_mid_epoch_elastic_resume_is_refused_before_anything_is_restored(index: Index, old: int, new: int) -> None:
    _, states = consume(index, old, 2)
    ds = make_ds(index, new, 0)
    before = ds.state_dict()
    with pytest.raises(TopologyMismatchError, match=(
            rf"saved mid-epoch \(epoch 0, batch 2\) on dp_size {old} with locality='shard'.*seen twice or "
            rf"never; resume on the saved layout \(dp_size {old}\), or from an epoch boundary.*locality='none'")):
        ds.load_state_dict(states[0], allow_elastic=True)
    assert ds.state_dict() == before
    assert batch_keys(ds) == batch_keys(make_ds(index, new, 0))  # nothing was restored


def test_accepting_it_would_see_samples_twice_or_never(index: Index) -> None:
    """Why it is refused: the old layout's consumed batches plus what the prefix rule of
    state/elastic.py would keep on the new layout are not the new layout's epoch."""
    old_plans = [make_ds(index, 4, r).plan(0) for r in range(4)]
    steps = len(old_plans[0]) // 2
    consumed = Counter(int(x) for p in old_plans for i in range(steps) for x in p[i].samples)
    rest: Counter[int] = Counter()
    for r in range(2):
        ds = make_ds(index, 2, r)
        view = elastic_view(lambda dp: make_ds(index, dp, 0).plan(0), 0, [(4, steps)], ds.plan(0))
        rest.update(int(x) for i in view.keep.tolist() for x in ds.plan(0)[i].samples)
    whole = Counter(int(x) for r in range(2) for b in make_ds(index, 2, r).plan(0) for x in b.samples)
    assert sum((consumed + rest).values()) == sum(whole.values())  # the batch counts do map
    assert consumed + rest != whole  # the samples do not
    assert locality_none_maps(index, steps)


def locality_none_maps(index: Index, steps: int) -> bool:
    """The same position with locality='none' maps exactly (the prefix rule holds there)."""
    olds = [make_ds(index, 4, r, locality="none") for r in range(4)]
    consumed = Counter(int(x) for ds in olds for i in range(steps) for x in ds.plan(0)[i].samples)
    rest: Counter[int] = Counter()
    for r in range(2):
        ds = make_ds(index, 2, r, locality="none")
        view = elastic_view(lambda dp: make_ds(index, dp, 0, locality="none").plan(0), 0, [(4, steps)], ds.plan(0))
        rest.update(int(x) for i in view.keep.tolist() for x in ds.plan(0)[i].samples)
    whole = Counter(int(x) for r in range(2) for b in make_ds(index, 2, r, locality="none").plan(0)
                    for x in b.samples)
    return consumed + rest == whole


def test_epoch_boundaries_map_onto_any_layout(index: Index) -> None:
    start = make_ds(index, 4, 1).state_dict()
    two = make_ds(index, 2, 1)
    two.load_state_dict(start, allow_elastic=True)
    assert batch_keys(two) == batch_keys(make_ds(index, 2, 1))
    done = make_ds(index, 4, 1)
    list(done)  # the whole of epoch 0
    two = make_ds(index, 2, 1)
    two.load_state_dict(done.state_dict(), allow_elastic=True)
    assert list(two) == []  # the saved epoch is finished
    two.set_epoch(1)
    fresh = make_ds(index, 2, 1)
    fresh.set_epoch(1)
    assert batch_keys(two) == batch_keys(fresh) != []


@pytest.mark.parametrize("allow_elastic", [False, True])
def test_on_the_saved_layout_it_resumes_exactly(index: Index, allow_elastic: bool) -> None:
    ds = make_ds(index, 4, 2)
    it = iter(ds)
    for _ in range(3):
        next(it)
    state = ds.state_dict()
    remainder = batch_keys(it)
    again = make_ds(index, 4, 2)
    again.load_state_dict(state, allow_elastic=allow_elastic)
    assert batch_keys(again) == remainder != []


def test_without_allow_elastic_the_refusal_does_not_suggest_it_for_a_mid_epoch_shard_state(index: Index) -> None:
    _, states = consume(index, 4, 2)
    with pytest.raises(TopologyMismatchError, match="allow_elastic=True does not help") as err:
        make_ds(index, 2, 0).load_state_dict(states[0])
    assert "or pass allow_elastic=True" not in str(err.value)
    _, boundary = consume(index, 4, 0)  # at the epoch's start the usual advice stands
    with pytest.raises(TopologyMismatchError, match="or pass allow_elastic=True"):
        make_ds(index, 2, 0).load_state_dict(boundary[0])
