"""``__seed__`` on every streamed sample: the plan's seed of that entry, on every read
path (the member table, shared-memory batches from workers, zero-copy views, the exact
path of ``fetch``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import webdataset as wds

from wds_pad.cli.synth import make_image_shards
from wds_pad.core.topology import Topology
from wds_pad.index.build import build_index
from wds_pad.index.codec import load_index
from wds_pad.index.record import Index
from wds_pad.stream.dataset import BucketedWebDataset
from wds_pad.stream.fetch import fetch
from wds_pad.stream.loader import Loader
from wds_pad.stream.stages import PlannedSource

pytestmark = [pytest.mark.filterwarnings("ignore::wds_pad.errors.DroppedBucketWarning"),
              pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")]


@pytest.fixture(scope="module")
def index(tmp_path_factory: pytest.TempPathFactory) -> Index:
    d: Path = tmp_path_factory.mktemp("shards")
    paths = make_image_shards(d, samples=90, shards=3, seed=2)
    return load_index(build_index(paths, "aspect:width,height", output=str(d / "i.wdsidx")).path)  # type: ignore[arg-type]


def _ds(index: Index, **kw: Any) -> BucketedWebDataset:
    return BucketedWebDataset(index, batch_size=4, seed=5, oversubscribe=True,
                              topology=Topology(world_size=2, rank=1), **kw)


def _planned(ds: BucketedWebDataset) -> list[list[int]]:
    return [b.seeds.tolist() for b in ds.plan()]


@pytest.mark.parametrize("how", ["inline", "workers", "zero_copy"])
def test_every_streamed_sample_carries_its_planned_seed(index: Index, how: str) -> None:
    ds = _ds(index, zero_copy=how == "zero_copy")
    batches = list(ds) if how == "inline" else list(Loader(ds, num_workers=2))
    got = [[s["__seed__"] for s in b] for b in batches]
    assert got == _planned(ds)
    assert all(isinstance(z, int) and 0 <= z < 2**64 for b in got for z in b)


def test_the_exact_path_of_fetch_carries_the_planned_seed(index: Index) -> None:
    ds = _ds(index)
    samples = list(wds.DataPipeline(PlannedSource(ds.spec), fetch(spec=ds.spec)))
    assert [s["__seed__"] for s in samples] == [z for b in _planned(ds) for z in b]
