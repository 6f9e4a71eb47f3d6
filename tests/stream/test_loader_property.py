"""Properties over Loader's configurations: whatever the workers, the batch sizing, the
member type, whether workers are kept, where a run stops and how many workers resume it,
the trainer gets exactly the batches of one process, in plan order, epoch after epoch.

The configurations reach every way a batch crosses from a worker: through its ring
(small samples), by reference (samples of ``REF_BYTES`` and more, ``bytes``), in its ring
with views (``zero_copy``), one batch a message (a budget, batch 1) or runs of them, and
loose (a transform in the worker); and over HTTP every way a remote sample is read: by
range, or whole shards (``locality="shard"``) in memory, through the job's own folder
(workers) or a ``cache_dir``, cold or warm.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from wds_pad import Budget, ReadOptions, Topology
from wds_pad.cli.synth import make_blob_shards, make_image_shards
from wds_pad.index.build import build_index
from wds_pad.index.codec import load_index
from wds_pad.index.record import Index
from wds_pad.io import shardmaps
from wds_pad.stream.loader import Loader
from wds_pad.stream.mappedbatch import REF_BYTES

from data_helpers import make_dataset, serve_dir

pytest_plugins = ["conftest_servers"]

pytestmark = [pytest.mark.filterwarnings("ignore::wds_pad.errors.DroppedBucketWarning"),
              pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")]


@pytest.fixture(scope="module")
def indexes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Index]:
    def indexed(name: str, paths: list[str]) -> Index:  # with a cost per sample, for budgets
        out = str(Path(paths[0]).parent / f"{name}.wdsidx")
        build_index(paths, "aspect:width,height", output=out, cost="bytes")
        return load_index(out)

    small = indexed("small", make_image_shards(tmp_path_factory.mktemp("small"), samples=72, shards=3, seed=5))
    large = indexed("large", make_blob_shards(tmp_path_factory.mktemp("large"), samples=40,
                                              sample_bytes=2 * REF_BYTES, shards=3, seed=6))
    assert float(np.mean(large.length)) >= REF_BYTES  # its batches go by reference
    return {"small": small, "large": large}


@pytest.fixture(autouse=True)
def _no_disk_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    """A page cache dropped by the machine meanwhile would turn mapping off (and with it
    batches by reference): the paths this property reaches would depend on the machine."""
    monkeypatch.setattr(shardmaps, "faults", lambda: 0)


def _sizing(index: Index, how: str) -> Any:
    if how == "budget":
        return Budget(4.0 * float(np.median(np.asarray(index.cost, dtype=np.float64))))
    return int(how)


def _tag(sample: dict[str, Any]) -> dict[str, Any]:
    """A per-sample transform: the batch travels loose (pickled), not packed."""
    return {**sample, "__tag__": sample["__key__"][::-1]}


def _ds(index: Index | str, sizing: Any, zero_copy: bool = False, transform: bool = False, **kw: Any) -> Any:
    ds = make_dataset(index, quiet=True, seed=3, batch_size=sizing, topology=Topology(1, 0),
                      check_agreement=False, zero_copy=zero_copy, **kw)
    return ds.map(_tag) if transform else ds


def _plain(batch: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A batch with every member as bytes: views compare with bytes."""
    return [{k: bytes(v) if isinstance(v, memoryview) else v for k, v in s.items()} for s in batch]


def _epoch(loader: Loader, epoch: int, stop: int | None = None) -> list[list[dict[str, Any]]]:
    loader.set_epoch(epoch)
    out = []
    for batch in loader:
        out.append(_plain(batch))
        if stop is not None and len(out) == stop:
            break
    return out


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.sampled_from(["small", "large"]), sizing=st.sampled_from(["1", "3", "4", "7", "budget"]),
       workers=st.integers(1, 4), again=st.integers(0, 3), zero_copy=st.booleans(), kept=st.booleans(),
       transform=st.booleans(), stop=st.integers(0, 12))
def test_loader_batches_are_one_process_batches_in_any_configuration(
        indexes: dict[str, Index], data: str, sizing: str, workers: int, again: int, zero_copy: bool,
        kept: bool, transform: bool, stop: int) -> None:
    index = indexes[data]
    size = _sizing(index, sizing)
    want = [_epoch(Loader(_ds(index, size, transform=transform), num_workers=0), e) for e in (0, 1)]
    stop = min(stop, len(want[0]))

    first = Loader(_ds(index, size, zero_copy, transform), num_workers=workers, persistent_workers=kept)
    got = _epoch(first, 0, stop) if stop else []
    state = first.state_dict()
    first.close()
    resumed = Loader(_ds(index, size, zero_copy, transform), num_workers=again, persistent_workers=kept and again > 0)
    resumed.load_state_dict(state)
    for batch in resumed:  # the rest of epoch 0, from the saved position
        got.append(_plain(batch))
    assert got == want[0]
    assert _epoch(resumed, 1) == want[1]
    resumed.close()


def _unplaced(batches: list[list[dict[str, Any]]]) -> list[list[dict[str, Any]]]:
    """Batches without ``__url__``: a shard's URL is where it was read from."""
    return [[{k: v for k, v in s.items() if k != "__url__"} for s in b] for b in batches]


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(locality=st.sampled_from(["none", "shard"]), sizing=st.sampled_from(["1", "3", "4"]),
       workers=st.integers(0, 3), again=st.integers(0, 3), zero_copy=st.booleans(), kept=st.booleans(),
       cached=st.sampled_from([None, "cold", "warm"]), stop=st.integers(0, 10))
def test_loader_batches_over_http_are_local_batches_in_any_configuration(
        indexes: dict[str, Index], nginx_server: Any, tmp_path_factory: pytest.TempPathFactory, locality: str,
        sizing: str, workers: int, again: int, zero_copy: bool, kept: bool, cached: str | None, stop: int) -> None:
    index = indexes["small"]
    local = os.path.dirname(index.urls[0])
    url = serve_dir(nginx_server, Path(local), "property")
    want = [_unplaced(_epoch(Loader(_ds(index, int(sizing), locality=locality), num_workers=0), e)) for e in (0, 1)]
    stop = min(stop, len(want[0]))
    folder = str(tmp_path_factory.mktemp("cache")) if cached else None

    def remote() -> Any:
        return _ds(str(index.path), int(sizing), zero_copy, locality=locality, relocate={local: url},
                   read_options=ReadOptions(cache_dir=folder))

    if cached == "warm":  # a job before this one filled the folder
        _epoch(Loader(remote(), num_workers=0), 0)
    first = Loader(remote(), num_workers=workers, persistent_workers=kept and workers > 0)
    got = _epoch(first, 0, stop) if stop else []
    state = first.state_dict()
    first.close()
    resumed = Loader(remote(), num_workers=again, persistent_workers=kept and again > 0)
    resumed.load_state_dict(state)
    for batch in resumed:
        got.append(_plain(batch))
    assert resumed.dataset.spec.indexes[0].urls[0].startswith("http://")
    assert _unplaced(got) == want[0]
    assert _unplaced(_epoch(resumed, 1)) == want[1]
    resumed.close()


@pytest.fixture(scope="module")
def dealt(tmp_path_factory: pytest.TempPathFactory) -> Index:
    """Enough shards to deal among 4 DP ranks under ``locality="shard"``."""
    folder = tmp_path_factory.mktemp("dealt")
    out = str(folder / "ix.wdsidx")
    build_index(make_image_shards(folder, samples=120, shards=8, seed=9), "aspect:width,height", output=out)
    return load_index(out)


def _rank(index: Index, dp: int, cp: int, rank: int, batch: int, locality: str) -> Any:
    return make_dataset(index, quiet=True, seed=5, batch_size=batch, check_agreement=False, locality=locality,
                        window=2, topology=Topology(dp * cp, rank, cp_size=cp))


def _real(batches: list[list[dict[str, Any]]]) -> list[str]:
    """The keys of the samples trained on, padded copies left out, sorted."""
    return sorted(s["__key__"] for b in batches for s in b if not s["__pad__"])


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(old=st.tuples(st.integers(1, 4), st.sampled_from([1, 2])), new=st.tuples(st.integers(1, 4), st.sampled_from([1, 2])),
       locality=st.sampled_from(["none", "shard"]), batch=st.integers(1, 4), workers=st.integers(0, 2),
       again=st.integers(0, 2), frac=st.floats(0.0, 1.0))
def test_an_elastic_resume_through_loaders_trains_every_sample_once(
        dealt: Index, old: tuple[int, int], new: tuple[int, int], locality: str, batch: int, workers: int,
        again: int, frac: float) -> None:
    """Every rank of the old layout (``(dp, cp)``) takes the same number of batches through a
    Loader; the new layout's ranks resume from a saved state each with ``allow_elastic``:
    each new DP rank gets as many batches as the others, context-parallel peers the same
    batches, and over the DP ranks every sample of the old layout's epoch is trained on once
    (of the new layout's, from a state saved before the epoch's first batch)."""
    (dp0, cp0), (dp1, cp1) = old, new
    plans = [len(_rank(dealt, dp0, cp0, r, batch, locality).plan(0)) for r in range(dp0 * cp0)]
    assert len(set(plans)) == 1
    steps = round(plans[0] * frac)
    epoch: list[list[dict[str, Any]]] = []
    consumed: list[list[dict[str, Any]]] = []
    states = []
    for r in range(dp0 * cp0):
        loader = Loader(_rank(dealt, dp0, cp0, r, batch, locality), num_workers=workers)
        mine = _epoch(loader, 0, steps) if steps else []
        states.append(loader.state_dict())
        loader.close()
        if r % cp0 == 0:  # one rank of each context-parallel group: its peers train on the same samples
            consumed += mine
            epoch += list(_rank(dealt, dp0, cp0, r, batch, locality))
    rest: dict[int, list[list[dict[str, Any]]]] = {}
    for r in range(dp1 * cp1):
        loader = Loader(_rank(dealt, dp1, cp1, r, batch, locality), num_workers=again)
        loader.load_state_dict(states[r * len(states) // (dp1 * cp1)], allow_elastic=True)
        rest[r] = [_plain(b) for b in loader]
        loader.close()
    assert len({len(b) for b in rest.values()}) == 1, "every new rank gets as many batches"
    for r in range(0, dp1 * cp1, cp1):
        assert all(rest[r + c] == rest[r] for c in range(cp1)), "context-parallel peers share their batches"
    trained = consumed + [b for r in range(0, dp1 * cp1, cp1) for b in rest[r]]
    if not steps:  # a state at the epoch's start: the new layout plans the epoch afresh, as its own
        epoch = [b for r in range(0, dp1 * cp1, cp1) for b in _rank(dealt, dp1, cp1, r, batch, locality)]
    assert _real(trained) == _real(epoch)
    assert len(set(_real(trained))) == len(_real(trained)), "no sample twice"
