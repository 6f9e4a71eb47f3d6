"""Tests of wds_pad.state.spec: PlanSpec, the plan's identity.

It lists the plan's arguments once (for the epoch's plan and the elastic remainder),
pickles into workers as index paths, keeps its fingerprint fields byte for byte, and
is seen on another data-parallel layout as ``dataclasses.replace(spec, topology=...)``.
"""

from __future__ import annotations

import dataclasses
import pickle
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from wds_pad.cli.synth import make_image_shards
from wds_pad.core.local.locality import Locality
from wds_pad.core.planning.plan import plan_epoch
from wds_pad.core.policy import PadTo, Policy
from wds_pad.core.elastic.remainder import Segment, plan_remainder
from wds_pad.core.topology import Topology
from wds_pad.errors import ConfigError
from wds_pad.index.build import build_index
from wds_pad.index.codec import load_index
from wds_pad.index.record import Index
from wds_pad.state import elastic_view
from wds_pad.state.schema import fingerprint_of
from wds_pad.state.spec import PlanSpec
from wds_pad.stream.dataset import BucketedWebDataset

SOLO = Topology(world_size=1, rank=0)
pytestmark = pytest.mark.filterwarnings("ignore::wds_pad.errors.DroppedBucketWarning")


@pytest.fixture(scope="module")
def index(tmp_path_factory: pytest.TempPathFactory) -> Index:
    shard_dir: Path = tmp_path_factory.mktemp("shards")
    paths = make_image_shards(shard_dir, samples=120, shards=4, seed=0)
    built = build_index(paths, "aspect:width,height", output=str(shard_dir / "index.wdsidx"))
    return load_index(built.path)  # type: ignore[arg-type]


def _spec(index: Index, **kw: Any) -> PlanSpec:
    args: dict[str, Any] = dict(indexes=(index,), names=("img",), topology=SOLO, seed=7, batch_size=4)
    args.update(kw)
    return PlanSpec(**args)


def _planned_keys(index: Index, spec: PlanSpec, epoch: int = 0) -> list[list[str]]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = spec.plan(epoch)
    return [[index.key(int(i)) for i in b.samples] for b in plan]


def test_planspec_defaults_plan_every_index(index: Index) -> None:
    spec = _spec(index)
    assert spec.repeats == (0,) and spec.weights == (1.0,)
    assert len(spec.plan(0)) > 0


def test_planspec_refuses_mismatched_per_index_values(index: Index) -> None:
    with pytest.raises(ConfigError, match="repeats"):
        _spec(index, repeats=(0, 1))
    with pytest.raises(ConfigError, match="name"):
        _spec(index, names=("a", "b"))


def test_planspec_refuses_the_same_samples_twice_and_says_to_use_repeats(index: Index, tmp_path: Path) -> None:
    """The same index (object, file loaded again, or a copy beside it) planned as two
    datasets would read each sample twice per epoch: refused, naming both, pointing at repeats."""
    copy = Path(index.path).with_name("copy.wdsidx")  # type: ignore[arg-type]
    shutil.copyfile(index.path, copy)  # type: ignore[arg-type]
    for second in (index, load_index(index.path), load_index(str(copy))):  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match=r"index 'b' .* same samples as index 'a' .*repeats=N"):
            _spec(index, indexes=(index, second), names=("a", "b"))
    with pytest.raises(ConfigError, match="same samples"):
        BucketedWebDataset([index.path, index.path], batch_size=4, seed=7, topology=SOLO)  # type: ignore[list-item]
    other_dir = tmp_path / "other"
    other_dir.mkdir()
    other = build_index(make_image_shards(other_dir, samples=20, shards=2, seed=1), "aspect:width,height")
    assert len(_spec(index, indexes=(index, other), names=("a", "b")).plan(0)) > 0  # other samples: planned


def test_planspec_pickles_index_as_path_and_replans_identically(index: Index) -> None:
    spec = _spec(index)
    spec.plan(0)
    clone = pickle.loads(pickle.dumps(spec))
    assert clone.indexes[0].path == index.path and clone.indexes[0].digest == index.digest
    assert clone._cache == {}
    assert _planned_keys(index, clone) == _planned_keys(index, spec)
    assert clone.fingerprint() == spec.fingerprint()


@pytest.mark.parametrize("locality", ["none", "shard"])
def test_plan_kwargs_are_the_arguments_of_the_plan_and_of_the_remainder(index: Index, locality: str) -> None:
    spec = _spec(index, topology=Topology(world_size=3, rank=1), pad_to=PadTo.RANK, repeats=(1,),
                 locality=Locality(locality), window=2, policy=Policy.CYCLIC)
    kw = spec.plan_kwargs()
    assert set(kw) == {"seed", "batch_size", "policy", "mode", "oversubscribe", "pad_to", "locality", "window",
                       "accumulation_steps", "mix_by", "epoch_size"}
    direct = plan_epoch(spec.datasets(), spec.topology, epoch=1, **kw)
    assert np.array_equal(direct.samples, spec.plan(1).samples)
    segments = (Segment(2, steps=3),)
    view = elastic_view(spec, 1, segments)
    again = plan_remainder(spec.datasets(), spec.topology, segments, epoch=1, **kw)
    assert np.array_equal(view.plan.samples, again.plan.samples) and view.fingerprint == again.fingerprint


def test_another_layout_is_a_replaced_spec_with_a_cache_of_its_own(index: Index) -> None:
    spec = _spec(index, topology=Topology(world_size=4, rank=3))
    spec.plan(0)
    other = dataclasses.replace(spec, topology=Topology(world_size=2, rank=0))
    assert other._cache == {} and other._cache is not spec._cache
    assert other.topology.dp_size == 2 and spec.topology.dp_size == 4
    assert len(other.plan(0)) != len(spec.plan(0))
    assert set(spec._cache) == {0} and set(other._cache) == {0} and other._cache[0] is not spec._cache[0]
    assert other.fingerprint_fields()["dp_size"] == 2


def test_fingerprint_fields_are_the_state_plan_block(index: Index) -> None:
    spec = _spec(index, topology=Topology(world_size=4, rank=1))
    fields = spec.fingerprint_fields()
    by_rank = _spec(index, pad_to=PadTo.RANK, topology=Topology(world_size=4, rank=1))
    assert fields["pad_unit"] == 16 and by_rank.fingerprint_fields()["pad_unit"] == 4
    assert list(fields) == ["seed_hash", "batch_size", "policy", "mode", "pad_to", "dp_size", "pad_unit",
                            "oversubscribe", "datasets"]
    assert spec.fingerprint() == fingerprint_of(fields)
    shard = _spec(index, locality=Locality.SHARD, window=3).fingerprint_fields()
    assert (shard["locality"], shard["window"], shard["shard_order"]) == ("shard", 3, "fifo")

