"""Elastic resume (``load_state_dict(state, allow_elastic=True)``) with locality="shard".

With locality="shard" a bucket's order depends on the layout (the shards are dealt to
the DP ranks), so what the old layout consumed is no prefix of the new layout's order.
core/elastic/remainder.py plans what is left instead: each old rank's remaining entries, dealt
to the new ranks in blocks (so a new rank reads a few old ranks' remaining shards).
Mid-epoch, every sample not yet trained on is resumed exactly once, on any layout.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from wds_pad.core.topology import Topology
from wds_pad.errors import TopologyMismatchError
from wds_pad.index.record import Index
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


def real_keys(batches: Any) -> Counter[str]:
    return Counter(s["__key__"] for b in batches for s in b if not s["__pad__"])


@pytest.mark.parametrize("old,new", [(4, 2), (2, 4), (4, 1), (3, 2)])
def test_mid_epoch_elastic_resume_is_exact(index: Index, old: int, new: int) -> None:
    batches, states = consume(index, old, 2)
    epoch = real_keys(b for r in range(old) for b in make_ds(index, old, r))
    rest, lengths = [], set()
    for r in range(new):
        ds = make_ds(index, new, r)
        ds.load_state_dict(states[r * old // new], allow_elastic=True)
        mine = list(ds)
        assert len(mine) == len(ds) == ds.state_dict()["batches_in_epoch"]
        lengths.add(len(mine))
        rest += mine
    assert len(lengths) == 1, "every new rank gets the same batch count"
    assert real_keys(batches) + real_keys(rest) == epoch, "every sample of the epoch exactly once"


def test_it_composes_4_to_3_to_2(index: Index) -> None:
    consumed, states = consume(index, 4, 3)
    epoch = real_keys(b for r in range(4) for b in make_ds(index, 4, r))
    states3 = []
    for r in range(3):
        ds = make_ds(index, 3, r)
        ds.load_state_dict(states[0], allow_elastic=True)
        it = iter(ds)
        consumed += [next(it) for _ in range(2)]
        states3.append(ds.state_dict())
        assert [s[:2] for s in states3[-1]["elastic"]["segments"]] == [[4, 3]]
    rest = []
    for r in range(2):
        ds = make_ds(index, 2, r)
        ds.load_state_dict(states3[r], allow_elastic=True)
        rest += list(ds)
    assert real_keys(consumed) + real_keys(rest) == epoch


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


def test_without_allow_elastic_the_refusal_suggests_it_for_a_mid_epoch_shard_state(index: Index) -> None:
    _, states = consume(index, 4, 2)
    with pytest.raises(TopologyMismatchError, match="or pass allow_elastic=True") as err:
        make_ds(index, 2, 0).load_state_dict(states[0])
    assert "topology.world_size: saved 4, now 2" in str(err.value)


@pytest.fixture(scope="module")
def eight(tmp_path_factory: pytest.TempPathFactory) -> Index:
    """8 shards of skewed aspect buckets."""
    return image_index(tmp_path_factory.mktemp("eight"), samples=120, shards=8, seed=22)


@pytest.mark.parametrize("locality", ["none", "shard"])
@pytest.mark.parametrize("old,steps,new", [(4, 3, 2), (4, 5, 3), (2, 7, 4), (3, 4, 1)])
def test_rank_changes_mid_epoch_on_skewed_shards_resume_exactly(eight: Index, old: int, steps: int, new: int,
                                                                 locality: str) -> None:
    """Batch 2, cyclic padding: 4->2 after 3 steps, 4->3 after 5, 2->4 after 7, 3->1 after 4."""
    kw = {"batch_size": 2, "pad": "cyclic", "locality": locality}
    olds = [make_ds(eight, old, r, **kw) for r in range(old)]
    assert 0 < steps < len(olds[0].plan(0))
    epoch = real_keys(b for ds in olds for b in ds)
    consumed, states = [], []
    for r in range(old):
        ds = make_ds(eight, old, r, **kw)
        it = iter(ds)
        consumed += [next(it) for _ in range(steps)]
        states.append(ds.state_dict())
    rest, lengths = [], set()
    for r in range(new):
        ds = make_ds(eight, new, r, **kw)
        ds.load_state_dict(states[r * old // new], allow_elastic=True)
        mine = list(ds)
        lengths.add(len(mine))
        rest += mine
    assert len(lengths) == 1
    assert real_keys(consumed) + real_keys(rest) == epoch
