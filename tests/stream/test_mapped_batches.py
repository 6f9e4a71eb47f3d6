"""Kept DataLoader workers send batches of mapped shards by reference, and the main process
copies each member once out of its own mapping (stream/mappedbatch.py).

Everything is checked against the batches of one process reading with ``os.pread``: the
same sample dicts in plan order, for samples of one to three members and large ones;
which batches go by reference is counted in the main process; a main process whose copy
waits for the disk turns references off for the workers; a shard changed or cut short
before the main process copies is one clear error naming it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

from wds_pad import ReadOptions, StaleShardError, Topology
from wds_pad.index.record import Index
from wds_pad.io import shardmaps
from wds_pad.stream import mappedbatch
from wds_pad.stream.fetch import fetch
from wds_pad.stream.loader import Loader
from wds_pad.stream.mappedbatch import REFS, MappedBatch, MappedShards

from data_helpers import image_index, make_dataset, open_descriptors
from test_mapped_shards import _large_index, _members_index

pytestmark = pytest.mark.filterwarnings("ignore::wds_pad.errors.DroppedBucketWarning")

BATCH = 4


@pytest.fixture(autouse=True)
def fresh(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Nothing seen, nothing kept, mapping on; no copy counts as waiting for the disk (a
    page the kernel dropped meanwhile would turn mapping off: tested on its own below);
    samples of any size go by reference (the threshold is tested on its own below)."""
    shardmaps._forget()
    monkeypatch.setattr(shardmaps, "faults", lambda: 0)
    monkeypatch.setattr(mappedbatch, "REF_BYTES", 0)
    yield
    shardmaps._forget()


@pytest.fixture
def received(monkeypatch: pytest.MonkeyPatch) -> list[MappedBatch]:
    """The batches the main process copied by reference, in order."""
    got: list[MappedBatch] = []
    monkeypatch.setattr(MappedShards, "members", _count(got, MappedShards.members))
    return got


def _count(got: list[MappedBatch], real: Any) -> Any:
    def call(self: MappedShards, batch: MappedBatch) -> Any:
        got.append(batch)
        return real(self, batch)
    return call


def _ds(index: Index, **kw: Any) -> Any:
    return make_dataset(index, quiet=True, seed=7, batch_size=BATCH, topology=Topology(1, 0),
                        check_agreement=False, **kw)


def _plain(batches: list[Any]) -> list[Any]:
    return [[{k: bytes(v) if isinstance(v, memoryview) else v for k, v in s.items()} for s in b] for b in batches]


def _one_process(index: Index, epochs: int) -> list[Any]:
    ds = _ds(index, read_options=ReadOptions(map_local=False))
    out = []
    for epoch in range(epochs):
        ds.set_epoch(epoch)
        out.append(_plain(list(ds)))
    return out


def _loaded(ds: Any, epochs: int, received: list[MappedBatch], **kw: Any) -> tuple[list[Any], list[int]]:
    """:func:`_epochs` of a Loader of ``ds`` made with ``kw``, closed after."""
    loader = Loader(ds, **kw)
    try:
        return _epochs(loader, epochs, received)
    finally:
        loader.close()


def _epochs(loader: Loader, epochs: int, received: list[MappedBatch]) -> tuple[list[Any], list[int]]:
    """Each epoch's batches, and how many of them came by reference."""
    out, refs = [], []
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        before = len(received)
        out.append(_plain(list(loader)))
        refs.append(len(received) - before)
    return out, refs


@pytest.mark.parametrize("shards", ["image", "members", "large"])
@pytest.mark.parametrize(("workers", "kept"), [(1, True), (2, True), (2, False)])
def test_workers_send_batches_by_reference_and_give_the_batches_of_one_process(
        tmp_path: Path, received: list[MappedBatch], shards: str, workers: int, kept: bool) -> None:
    if shards == "image":
        index = image_index(tmp_path, samples=96, shards=3, seed=5)
    else:
        index = _members_index(tmp_path) if shards == "members" else _large_index(tmp_path, samples=24, shards=2)
    got, refs = _loaded(_ds(index), 3, received, num_workers=workers, persistent_workers=kept)
    assert got == _one_process(index, 3)  # the same samples, members, fields and order
    batches = len(got[1])
    if kept:  # a kept worker maps a shard from its second stream of it on (shardmaps' rule)
        assert refs[0] == 0
        for n in refs[1:]:  # a shard the worker did not stream before goes through its ring once
            assert max(1, batches - workers * len(index.urls)) <= n <= batches, refs
    else:  # a worker of one epoch streams each shard once: it maps them at once
        assert refs == [batches] * 3
    assert all(type(v) is bytes for b in got[2] for s in b for k, v in s.items() if not k.startswith("__"))
    if shards == "members":
        assert {sum(not k.startswith("__") for k in s) for b in got[2] for s in b} == {1, 2, 3}


@pytest.mark.parametrize("shards", ["image", "large"])
def test_only_large_samples_go_by_reference(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            received: list[MappedBatch], shards: str) -> None:
    """Small ones go through the ring: the main process copies them out of it while the
    worker's writes are still in the CPU's cache, faster than out of the page cache."""
    monkeypatch.undo()  # the threshold as shipped
    shardmaps._forget()
    monkeypatch.setattr(shardmaps, "faults", lambda: 0)
    monkeypatch.setattr(MappedShards, "members", _count(received, MappedShards.members))
    index = image_index(tmp_path, samples=48, shards=2, seed=6) if shards == "image" else _large_index(
        tmp_path, samples=16, shards=2)
    mean = float(index.length.mean())
    assert (mean < mappedbatch.REF_BYTES) == (shards == "image")
    got, refs = _loaded(_ds(index), 2, received, num_workers=2)
    assert got == _one_process(index, 2)
    assert refs == ([0, 0] if shards == "image" else [len(got[0])] * 2)


@pytest.mark.parametrize("how", ["zero_copy", "a stage"])
@pytest.mark.parametrize("kept", [True, False])
def test_views_and_transformed_samples_never_go_by_reference(
        tmp_path: Path, received: list[MappedBatch], how: str, kept: bool) -> None:
    """A view must not be of a mapping (it could outlive the file's size), and a copy out
    of one would be the main process's to make; a transformed sample is made in its
    worker and pickled: it does not travel packed."""
    index = image_index(tmp_path, samples=48, shards=2, seed=6)
    ds = _ds(index, zero_copy=how == "zero_copy")
    if how == "a stage":
        ds = ds.compose(lambda src: ({**s, "n": len(s["json"])} for s in src))
    got, refs = _loaded(ds, 3, received, num_workers=2, persistent_workers=kept)
    assert refs == [0, 0, 0]
    want = _one_process(index, 3)
    if how == "a stage":
        want = [[[{**s, "n": len(s["json"])} for s in b] for b in e] for e in want]
    assert got == want


def test_a_worker_whose_header_checks_waited_for_the_disk_reads_into_its_ring(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, received: list[MappedBatch]) -> None:
    """Its headers were not in the page cache, so its payloads may not be either: the batch
    goes through the worker's ring (the wait overlaps the training step), and the worker
    maps no more."""
    index = image_index(tmp_path, samples=96, shards=3, seed=5)
    main, waits = os.getpid(), iter(range(10**6))
    monkeypatch.setattr(shardmaps, "faults", lambda: 0 if os.getpid() == main else next(waits))
    got, refs = _loaded(_ds(index), 2, received, num_workers=2)
    assert got == _one_process(index, 2)
    assert refs == [0, 0]
    assert shardmaps.stopped() is None  # the main process maps on


def test_a_main_process_copy_that_waited_for_the_disk_turns_references_off(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, received: list[MappedBatch]) -> None:
    """The main process then maps no more (its copies would wait on the training loop's
    time): the workers read and copy the rest into their rings, where waiting overlaps."""
    index = image_index(tmp_path, samples=96, shards=3, seed=5)
    main, waits = os.getpid(), iter(range(10**6))
    monkeypatch.setattr(shardmaps, "faults", lambda: next(waits) if os.getpid() == main else 0)
    loader = Loader(_ds(index), num_workers=2, persistent_workers=True)
    try:
        got, refs = _epochs(loader, 3, received)
        flag = int(loader._refs[REFS])
    finally:
        loader.close()
    assert got == _one_process(index, 3)
    assert "waited for the disk" in (shardmaps.stopped() or "")
    assert flag == 1
    assert refs[0] == 0 and 1 <= refs[1] and refs[2] == 0  # in flight when it waited: read with os.pread here
    assert refs[1] <= 2 * 2 * 8 + 1  # at most what two workers had prefetched (2 runs of at most 8 batches each)


def test_references_come_back_at_an_iteration_after_the_main_process_maps_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, received: list[MappedBatch]) -> None:
    """The main process's copies of epoch 1 wait for the disk: its workers copy into their
    rings from then on; RETRY_SECONDS later it maps again, and the loader's next iteration
    has them send by reference again. Every epoch is one process's."""
    index = image_index(tmp_path, samples=96, shards=3, seed=5)
    main, waiting, count = os.getpid(), [False], iter(range(1, 10**6))
    monkeypatch.setattr(shardmaps, "faults", lambda: next(count) if waiting[0] and os.getpid() == main else 0)
    now = [1000.0]
    monkeypatch.setattr(shardmaps.time, "monotonic", lambda: now[0])
    loader = Loader(_ds(index), num_workers=2, persistent_workers=True)
    got, refs, flags = [], [], []
    try:
        for epoch in range(4):
            waiting[0] = epoch == 1
            now[0] += shardmaps.RETRY_SECONDS if epoch == 3 else 0
            loader.set_epoch(epoch)
            before = len(received)
            got.append(_plain(list(loader)))
            refs.append(len(received) - before)
            flags.append(int(loader._refs[REFS]))
    finally:
        loader.close()
    assert got == _one_process(index, 4)
    assert refs[1] >= 1 and flags[1] == 1  # by reference until a copy waited
    assert refs[2] == 0 and flags[2] == 1  # the main process maps no more yet
    assert refs[3] > 0 and flags[3] == 0, refs  # mapping on again: by reference again


def _sent(tmp_path: Path, received: list[MappedBatch]) -> tuple[Index, MappedBatch, list[Any]]:
    """A batch a kept worker sent by reference, and its samples as the loader gave them."""
    index = image_index(tmp_path, samples=48, shards=2, seed=4)
    got, refs = _loaded(_ds(index), 2, received, num_workers=1, persistent_workers=True)
    assert refs[1] > 0
    batch = received[-1]
    return index, batch, next(b for b in got[1] if [s["__key__"] for s in b] == batch.keys)


def _members(index: Index, batch: MappedBatch, flags: np.ndarray | None = None) -> list[bytes]:
    ds = _ds(index)
    return MappedShards(fetch(ds.read_options, spec=ds.spec), np.zeros(1, np.int64) if flags is None else flags
                        ).members(batch)


def test_a_main_process_that_maps_no_more_reads_the_members_with_pread(
        tmp_path: Path, received: list[MappedBatch]) -> None:
    index, batch, samples = _sent(tmp_path, received)
    want = [v for s in samples for k, v in s.items() if not k.startswith("__")]
    assert _members(index, batch) == want
    shardmaps.stop("a test")
    flags = np.zeros(1, np.int64)
    assert _members(index, batch, flags) == want
    assert flags[REFS] == 1  # and the workers are told to copy from now on


@pytest.mark.parametrize("change", ["cut short", "rewritten"])
def test_a_shard_changed_before_the_main_process_copies_is_one_clear_error(
        tmp_path: Path, received: list[MappedBatch], change: str) -> None:
    """Cut short under the main process's mapping: its size check before the batch sends
    it to os.pread, whose short read names the shard (a copy past the end would kill the
    process); rewritten: opening it here finds it is not the indexed file."""
    index, batch, _ = _sent(tmp_path, received)
    url = batch.urls[-1]
    if change == "cut short":
        ds = _ds(index)
        shards = MappedShards(fetch(ds.read_options, spec=ds.spec), np.zeros(1, np.int64))
        shards.members(batch)  # mapped now
        os.truncate(url, int(batch.bounds[0, -1]) - 1)
        with pytest.raises(StaleShardError, match=f"{os.path.basename(url)}.*changed or shrank"):
            shards.members(batch)
        return
    with open(url, "ab") as f:
        f.write(b"\0" * 1024)
    with pytest.raises(StaleShardError, match=os.path.basename(url)):
        _members(index, batch)


def test_the_main_process_closes_its_shards_with_the_workers(tmp_path: Path, received: list[MappedBatch]) -> None:
    """Its reader's descriptors go with the workers; what stays open is the process's kept
    mappings' own (io/shardmaps.py, bounded there), as after a one-process loop."""
    index = image_index(tmp_path, samples=48, shards=2, seed=4)
    loader = Loader(_ds(index), num_workers=1, persistent_workers=True)
    _epochs(loader, 2, received)
    assert received
    assert open_descriptors(index.urls) == len(shardmaps._MAPS) + len(index.urls)  # held with the workers
    loader.close()
    assert open_descriptors(index.urls) == len(shardmaps._MAPS) == len(index.urls)


def test_a_batch_by_reference_outside_a_loader_is_refused_clearly() -> None:
    batch = MappedBatch(None, None, 0, 0, -1, np.zeros((2, 0), np.int64), [], [], [], [], [], [], ("b", "d", 0, 0, 0))
    with pytest.raises(RuntimeError, match="by reference"):
        batch.samples()
    assert mappedbatch.REFS == 0
