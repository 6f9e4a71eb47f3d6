"""Streaming under a budget: BucketedWebDataset and Loader with ``batch_size=Budget(...)``.

An index built with ``--cost image:pixels`` streams the plan's batches exactly, with 0 and
2 DataLoader workers, every batch within the budget; a state saved mid-epoch resumes at
the next batch; a state saved under another budget or accumulation is refused naming the
field; an index without costs is refused naming the fix.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from wds_pad import Budget, BucketedWebDataset, ConfigError, Loader, StateMismatchError, Topology
from wds_pad.cli.synth import make_image_shards
from wds_pad.core.budgets.budget import batch_cost
from wds_pad.index.build import build_index
from wds_pad.index.codec import load_index
from wds_pad.index.record import Index

pytestmark = [pytest.mark.filterwarnings("ignore::wds_pad.errors.DroppedBucketWarning"),
              pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")]
SOLO = Topology(world_size=1, rank=0)


@pytest.fixture(scope="module")
def index(tmp_path_factory: pytest.TempPathFactory) -> Index:
    folder = tmp_path_factory.mktemp("budget-shards")
    paths = make_image_shards(folder, samples=160, shards=4, seed=4)
    build_index(paths, "aspect:width,height", output=str(folder / "ix.wdsidx"), cost="image:pixels")
    return load_index(str(folder / "ix.wdsidx"))


def _budget(index: Index, factor: float = 6.0, model: str = "sum") -> Budget:
    return Budget(factor * float(np.median(np.asarray(index.cost))), model)


def _ds(index: Index, **kw: Any) -> BucketedWebDataset:
    args: dict[str, Any] = dict(batch_size=_budget(index), topology=SOLO, seed=11)
    args.update(kw)
    return BucketedWebDataset(index, **args)


def _planned(ds: BucketedWebDataset, index: Index) -> list[list[str]]:
    return [[index.key(int(i)) for i in b.samples] for b in ds.plan(0)]


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("model", ["sum", "max"])
def test_a_budgeted_loader_streams_the_plan_within_the_budget(index: Index, workers: int, model: str) -> None:
    ds = _ds(index, batch_size=_budget(index, model=model))
    batches = list(Loader(ds, num_workers=workers))
    got = [[s["__key__"] for s in b] for b in batches]
    assert got == _planned(ds, index) and len(got) > 4
    cost = {index.key(i): float(index.cost[i]) for i in range(len(index))}
    limit = ds.spec.batch_size.limit
    assert all(len(b) == 1 or batch_cost([cost[k] for k in b], model) <= limit for b in got)
    real = sorted(s["__key__"] for b in batches for s in b if not s["__pad__"])  # copies marked
    assert real == sorted(index.key(i) for i in range(len(index)))


def test_a_budgeted_state_resumes_at_the_next_batch_with_workers(index: Index) -> None:
    ds = _ds(index)
    loader = Loader(ds, num_workers=2)
    seen, state = [], None
    for i, batch in enumerate(loader):
        seen.append([s["__key__"] for s in batch])
        if i == 2:
            state = loader.state_dict()
            break
    again = Loader(_ds(index), num_workers=2)
    again.load_state_dict(state)
    rest = [[s["__key__"] for s in b] for b in again]
    assert seen + rest == _planned(ds, index)


def test_a_state_of_another_budget_or_accumulation_is_refused_naming_the_field(index: Index) -> None:
    state = Loader(_ds(index)).state_dict()
    with pytest.raises(StateMismatchError, match="plan.batch_size.limit"):
        Loader(_ds(index, batch_size=_budget(index, 7.0))).load_state_dict(state)
    with pytest.raises(StateMismatchError, match="plan.accumulation_steps"):
        Loader(_ds(index, accumulation_steps=2)).load_state_dict(state)


def test_accumulation_makes_the_epoch_whole_optimizer_steps_of_one_bucket(index: Index) -> None:
    ds = _ds(index, accumulation_steps=3)
    batches = list(Loader(ds))
    assert len(batches) % 3 == 0
    buckets = [b[0]["__bucket__"] for b in batches]
    assert all(len(set(buckets[i:i + 3])) == 1 for i in range(0, len(buckets), 3))


def test_a_budget_over_an_index_without_costs_is_refused_naming_the_fix(index: Index, tmp_path: Path) -> None:
    paths = make_image_shards(tmp_path, samples=20, shards=1, seed=1)
    build_index(paths, "aspect:width,height", output=str(tmp_path / "plain.wdsidx"))
    with pytest.raises(ConfigError, match="records no costs.*--cost"):
        BucketedWebDataset(load_index(str(tmp_path / "plain.wdsidx")), batch_size=Budget(1000), topology=SOLO, seed=1)
    with pytest.raises(ConfigError, match=r"follow the plan's budget [0-9.e+]+ \(sum\)"):
        _ds(index).batched(3)
