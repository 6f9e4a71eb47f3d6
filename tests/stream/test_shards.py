"""Tests of wds_pad.stream.shards (split_by_node, equalize) and wds_pad.stream.shardstream (resume).

Ranks are simulated in one process with explicit Topology records (the splitter and
equalize never talk to torch.distributed once the topology and seed are given);
DataLoader workers run as real worker processes, or are simulated through webdataset's
``WORKER``/``NUM_WORKERS`` variables for the large matrices.
"""

from __future__ import annotations

import collections
import io
import json
import os
import pickle
import random
from pathlib import Path
from typing import Any, Iterator

import fsspec
import pytest
import webdataset as wds
from fsspec.spec import AbstractFileSystem
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from gloo_jobs import run_gloo_job
from data_helpers import wds_reference
from resume_harness import check_start_mid_boundary, epochs_driver
from wds_pad.cli.synth import make_blob_shards
from wds_pad.errors import (ConfigError, StaleShardError, StateError, StateMismatchError,
                            TopologyMismatchError)
from wds_pad.index.record import Index
from wds_pad.index.build import build_index
from wds_pad.core.local.shardsplit import worker_plan
from wds_pad.stream.shards import Equalize, assign_shards, equalize, split_by_node
from wds_pad.stream.shardstream import ShardLoader, ShardStream
from wds_pad.core.topology import Topology

SEED = 7


def _shards(directory: Path, samples: int, shards: int) -> tuple[list[str], Index]:
    paths = make_blob_shards(directory, samples=samples, sample_bytes=700, shards=shards, seed=shards)
    return paths, build_index(paths, None, output=str(directory / "index.wdsidx"))


@pytest.fixture(scope="module")
def five(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[str], Index]:
    """Five uneven shards, 47 samples."""
    return _shards(tmp_path_factory.mktemp("five"), 47, 5)


@pytest.fixture(scope="module")
def three(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[str], Index]:
    """Three uneven shards, 20 samples: fewer shards than most worlds have ranks."""
    return _shards(tmp_path_factory.mktemp("three"), 20, 3)


@pytest.fixture(scope="module")
def reference(five: tuple[list[str], Index], three: tuple[list[str], Index]) -> dict[str, dict[str, Any]]:
    """webdataset's own reading of every sample, by key."""
    return {**wds_reference(five[0], by_url=True), **wds_reference(three[0], by_url=True)}


def _dropin(paths: list[str], index: Index, topo: Topology, epoch: int = 0, **kw: Any) -> Any:
    splitter = split_by_node(seed=SEED, epoch=epoch, topology=topo)
    return wds.WebDataset(paths, nodesplitter=splitter, shardshuffle=False, **kw).compose(equalize(index, splitter))


def _simulated(paths: list[str], index: Index, topo: Topology, workers: int,
               monkeypatch: pytest.MonkeyPatch) -> list[list[dict[str, Any]]]:
    """Each simulated worker's samples (webdataset reads WORKER/NUM_WORKERS)."""
    out = []
    for w in range(max(workers, 1)):
        monkeypatch.setenv("WORKER", str(w))
        monkeypatch.setenv("NUM_WORKERS", str(max(workers, 1)))
        out.append(list(_dropin(paths, index, topo, empty_check=False)))
    monkeypatch.delenv("WORKER")
    monkeypatch.delenv("NUM_WORKERS")
    return out


def _topologies() -> Iterator[tuple[int, int]]:
    for world in range(2, 9):
        for cp in (1, 2):
            if world % cp == 0:
                yield world, cp


# ---------------------------------------------------------------- assign_shards


@settings(max_examples=200, deadline=None)
@given(n=st.integers(0, 30), dp=st.integers(1, 12), seed=st.integers(0, 2**63), epoch=st.integers(0, 50))
def test_assign_shards_pads_cyclically_to_equal_counts(n: int, dp: int, seed: int, epoch: int) -> None:
    urls = [f"s3://b/shard-{i:03d}.tar" for i in range(n)]
    got = assign_shards(urls, seed, epoch, dp)
    assert len(got) == dp
    assert {len(r) for r in got} == ({-(-n // dp)} if n else {0})
    real = [u for r in got for u, pad in r if not pad]
    assert sorted(real) == urls  # every shard exactly once, unpadded
    padded = [u for r in got for u, pad in r if pad]
    assert len(padded) == (-n) % dp
    for r in got:
        assert len({u for u, _ in r}) == len(r)  # no rank holds a shard twice
    # padded copies come cyclically from the front of the shuffled order
    order = [got[p % dp][p // dp][0] for p in range(n)]
    assert padded == [order[i % n] for i in range(len(padded))] if n else not padded
    assert assign_shards(list(reversed(urls)), seed, epoch, dp) == got  # input order is irrelevant


def test_assign_shards_epochs_reorder_and_duplicates_refused() -> None:
    urls = [f"/data/s{i}.tar" for i in range(12)]
    orders = {tuple(u for r in assign_shards(urls, SEED, e, 3) for u, _ in r) for e in range(5)}
    assert len(orders) == 5
    assert assign_shards(urls, SEED, 2, 3) == assign_shards(urls, SEED, 2, 3)
    with pytest.raises(ConfigError, match="listed twice"):
        assign_shards(urls + ["/data/s3.tar"], SEED, 0, 2)


def test_relative_and_absolute_urls_get_the_same_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    rel = [f"d/s{i}.tar" for i in range(7)]
    absolute = [str(tmp_path / u) for u in rel]
    a = [[(str(tmp_path / u), p) for u, p in r] for r in assign_shards(rel, 3, 0, 3)]
    assert a == assign_shards(absolute, 3, 0, 3)


# ---------------------------------------------------------------- equalize: counts and coverage


@pytest.mark.parametrize("dataset", ["five", "three"])
@pytest.mark.parametrize("workers", [0, 1, 2])
def test_every_rank_yields_the_same_samples_count(dataset: str, workers: int, request: pytest.FixtureRequest,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    paths, index = request.getfixturevalue(dataset)
    every = {(s.url, index.key(i)) for i, s in ((i, index.shards[index.shard[i]]) for i in range(len(index)))}
    for world, cp in _topologies():
        per_rank = {}
        for rank in range(world):
            topo = Topology(world_size=world, rank=rank, cp_size=cp)
            per_rank[rank] = _simulated(paths, index, topo, workers, monkeypatch)
        # per worker (hence per rank) every rank yields exactly as many samples
        for w in range(max(workers, 1)):
            assert len({len(per_rank[r][w]) for r in range(world)}) == 1, (world, cp, w)
        # CP peers yield identical samples
        for rank in range(world):
            peer = (rank // cp) * cp
            assert [[s["__key__"] for s in ws] for ws in per_rank[rank]] == \
                   [[s["__key__"] for s in ws] for ws in per_rank[peer]]
        # over the DP ranks, the unpadded samples are every sample exactly once
        real = collections.Counter((s["__url__"], s["__key__"]) for rank in range(0, world, cp)
                                   for ws in per_rank[rank] for s in ws if not s["__pad__"])
        assert set(real) == every and set(real.values()) == {1}, (world, cp)
        keysets = {tuple(sorted(s)) for rank in range(world) for ws in per_rank[rank] for s in ws}
        assert keysets == {("__key__", "__local_path__", "__pad__", "__url__", "bin", "json")}


def test_padding_samples_are_the_indexed_samples(three: tuple[list[str], Index],
                                                 reference: dict[str, dict[str, Any]]) -> None:
    paths, index = three
    topo = Topology(world_size=8, rank=5)  # 3 shards, 8 ranks: most samples are padding
    samples = list(_dropin(paths, index, topo))
    assert any(s["__pad__"] for s in samples)
    for s in samples:
        ref = reference[s["__url__"] + "/" + s["__key__"]]
        assert s["bin"] == ref["bin"] and s["json"] == ref["json"]
        assert s["__local_path__"] == ref["__local_path__"]


def test_worker_targets_are_the_max_over_ranks(five: tuple[list[str], Index]) -> None:
    _, index = five
    counts = {s.url: s.samples for s in index.shards}
    for n in (1, 2, 3):
        for w in range(n):
            plans = [worker_plan(counts, SEED, 0, Topology(world_size=3, rank=r), w, n) for r in range(3)]
            held = [sum(counts[u] for u, _ in p.shards) for p in plans]
            assert {p.target for p in plans} == {max(held)}


@pytest.mark.parametrize("workers", [1, 2])
def test_real_dataloader_workers_and_collation(three: tuple[list[str], Index], workers: int) -> None:
    paths, index = three
    totals, batches = [], []
    for rank in range(4):  # 4 ranks, 3 shards: with 2 workers one worker of each rank has none
        topo = Topology(world_size=4, rank=rank)
        ds = (_dropin(paths, index, topo).decode().to_tuple("__key__", "bin", "json", "__pad__")
              .batched(3))
        got = list(DataLoader(ds, batch_size=None, num_workers=workers))
        totals.append(sum(len(b[0]) for b in got))
        batches.append(len(got))
        for keys, blobs, meta, pad in got:
            assert len(keys) == len(blobs) == len(meta) == len(pad)
            assert all(int.from_bytes(b[:8], "little") == m["index"] for b, m in zip(blobs, meta))
    assert len(set(totals)) == 1 and len(set(batches)) == 1


def test_epochs_reorder_shards_deterministically(five: tuple[list[str], Index]) -> None:
    paths, index = five
    topo = Topology(world_size=2, rank=1)
    splitter = split_by_node(seed=SEED, topology=topo)
    ds = wds.WebDataset(paths, nodesplitter=splitter, shardshuffle=False).compose(equalize(index, splitter))
    by_epoch = {}
    for epoch in (0, 1, 2, 0):
        splitter.set_epoch(epoch)
        keys = [s["__key__"] for s in ds]
        assert by_epoch.setdefault(epoch, keys) == keys
    assert len({tuple(v) for v in by_epoch.values()}) == 3


def test_pipeline_and_stream_pickle_small(five: tuple[list[str], Index]) -> None:
    paths, index = five
    topo = Topology(world_size=3, rank=2)
    ds = _dropin(paths, index, topo).to_tuple("__key__", "__pad__")
    eq = next(s for s in ds.pipeline if isinstance(s, Equalize))
    assert len(pickle.dumps(eq)) < 4096  # the index travels as its path, not its arrays
    restored = pickle.loads(pickle.dumps(ds))
    assert list(restored) == list(ds)
    stream = ShardStream(index, topology=topo, seed=SEED).to_tuple("__key__", "__pad__").batched(2)
    assert len(pickle.dumps(stream)) < 8192  # no index arrays in the pickle
    assert [b[0] for b in pickle.loads(pickle.dumps(stream))] == [b[0] for b in stream]


def test_pad_shard_marker_passes_every_opener(three: tuple[list[str], Index], tmp_path: Path) -> None:
    paths, index = three
    topo = Topology(world_size=4, rank=3)  # rank 3 holds a padded copy
    splitter = split_by_node(seed=SEED, topology=topo)
    assert [d["__pad_shard__"] for d in splitter(paths)] == [True]
    plain = [(s["__key__"], s["__pad__"]) for s in _dropin(paths, index, topo)]
    assert plain and all(pad for _, pad in plain)  # samples of a padded copy are marked
    pipe = wds.DataPipeline(wds.SimpleShardList(paths), splitter, wds.split_by_worker,
                            wds.tarfile_to_samples(), equalize(index, splitter))
    assert [(s["__key__"], s["__pad__"]) for s in pipe] == plain
    cache = tmp_path / "cache"
    cache.mkdir()
    cached = wds.WebDataset(paths, nodesplitter=splitter, shardshuffle=False, cache_dir=str(cache))
    assert [(s["__key__"], s["__pad__"]) for s in cached.compose(equalize(index, splitter))] == plain


def test_index_of_other_shards_is_refused(five: tuple[list[str], Index], three: tuple[list[str], Index]) -> None:
    paths, _ = five
    _, other = three
    with pytest.raises(ConfigError, match="not the one indexed.*only in the list"):
        list(_dropin(paths, other, Topology(world_size=2, rank=0)))
    with pytest.raises(ConfigError, match="split_by_node"):
        Equalize(other, lambda src: src)  # type: ignore[arg-type]


def test_reshuffled_shards_are_refused(five: tuple[list[str], Index]) -> None:
    paths, index = five
    splitter = split_by_node(seed=SEED, topology=Topology(world_size=1, rank=0))
    ds = wds.WebDataset(paths, nodesplitter=splitter, shardshuffle=100, seed=3)
    assert [s["__url__"] for s in ds] != [s["__url__"] for s in _dropin(paths, index, splitter.topology)]
    with pytest.raises(ConfigError, match="shardshuffle=False"):
        list(ds.compose(equalize(index, splitter)))


def test_a_shard_grown_since_indexing_is_detected(tmp_path: Path) -> None:
    paths, index = _shards(tmp_path, 12, 2)
    extra = make_blob_shards(tmp_path / "x", samples=3, sample_bytes=100, shards=1, seed=9)[0]
    with open(paths[0], "wb") as out, open(extra, "rb") as src:  # same name, other content
        out.write(src.read())
    with pytest.raises(StaleShardError):
        list(_dropin(paths, index, Topology(world_size=1, rank=0)))


# ---------------------------------------------------------------- ShardStream: same stream


def _stream(index: Index, topo: Topology, **kw: Any) -> ShardStream:
    return ShardStream(index, topology=topo, seed=kw.pop("seed", SEED), **kw)


@pytest.mark.parametrize("workers", [0, 2])
def test_shardstream_yields_what_the_dropin_yields(three: tuple[list[str], Index], workers: int) -> None:
    paths, index = three
    for rank in (0, 3):
        topo = Topology(world_size=4, rank=rank)
        for epoch in (0, 1):
            dropin = wds.WebLoader(_dropin(paths, index, topo, epoch=epoch), batch_size=None, num_workers=workers)
            ds = _stream(index, topo, epoch=epoch)
            assert list(ShardLoader(ds, num_workers=workers)) == list(dropin)


# ---------------------------------------------------------------- ShardStream: resume


def _roundtrip(state: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(state))


def _keys(items: list[Any]) -> list[Any]:
    return [tuple(b[0]) if isinstance(b, (list, tuple)) else b["__key__"] for b in items]


@pytest.mark.parametrize("workers", [0, 1, 2])
@pytest.mark.parametrize("batched", [False, True])
def test_resume_mid_shard_equals_the_uninterrupted_remainder(five: tuple[list[str], Index], workers: int,
                                                             batched: bool) -> None:
    _, index = five
    topo = Topology(world_size=2, rank=1)

    def make() -> ShardLoader:
        ds = _stream(index, topo, epoch=3)
        if batched:
            ds = ds.to_tuple("__key__", "bin").batched(3)
        return ShardLoader(ds, num_workers=workers)

    full = _keys(list(make()))
    rng = random.Random(workers * 10 + batched)
    for cut in sorted(rng.sample(range(1, len(full)), 3)):
        loader = make()
        it = iter(loader)
        head = [next(it) for _ in range(cut)]
        state = _roundtrip(loader.state_dict())
        it.close()
        resumed = make()
        resumed.load_state_dict(state)
        assert _keys(head) + _keys(list(resumed)) == full, cut
        assert resumed.state_dict()["done"]


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_at_start_mid_epoch_and_across_the_epoch_boundary(three: tuple[list[str], Index],
                                                                  workers: int) -> None:
    _, index = three
    topo = Topology(world_size=4, rank=1, cp_size=2)
    make = lambda: ShardLoader(_stream(index, topo), num_workers=workers)  # noqa: E731
    epoch0 = len(list(make()))
    stops = check_start_mid_boundary(make, drive=epochs_driver(1), boundaries=[epoch0],
                                     key=lambda s: (s["__url__"], s["__key__"], s["__pad__"]))
    assert epoch0 in stops and len(stops) >= 5


def test_resume_reads_the_shard_from_the_saved_offset(five: tuple[list[str], Index], tmp_path: Path) -> None:
    paths, _ = five
    index = build_index([f"counting://{p}" for p in paths], None)
    topo = Topology(world_size=1, rank=0)
    ds = _stream(index, topo)
    it = iter(ds)
    for _ in range(4):
        last = next(it)
    state = ds.state_dict()
    it.close()
    pos = state["workers"][0]
    url = ds.plan().shard_at(pos["shard"])[0]
    assert last["__url__"] == url and pos["offset"] > 0  # mid-shard
    _Counting.reads.clear()
    resumed = _stream(index, topo)
    resumed.load_state_dict(state)
    first = next(iter(resumed))
    path = url[len("counting://"):]
    spans = [(a, b) for p, a, b in _Counting.reads if p == path]
    assert spans and min(a for a, _ in spans) == pos["offset"]  # nothing before the offset again
    assert first["__key__"] == str(int(last["__key__"]) + 1).zfill(len(last["__key__"]))


def test_refusals_leave_the_stream_unchanged(five: tuple[list[str], Index], three: tuple[list[str], Index]) -> None:
    _, index = five
    topo = Topology(world_size=2, rank=0)
    ds = _stream(index, topo)
    it = iter(ds)
    next(it), next(it)
    state = _roundtrip(ds.state_dict())
    cases = [
        (_stream(index, Topology(world_size=2, rank=1)), TopologyMismatchError, "topology.rank"),
        (_stream(index, Topology(world_size=4, rank=0)), TopologyMismatchError, "topology.world_size"),
        (_stream(index, Topology(world_size=2, rank=0, cp_size=2)), TopologyMismatchError, "cp_size"),
        (_stream(index, topo, seed=8), StateMismatchError, "plan.seed_hash"),
        (_stream(three[1], topo), StateMismatchError, "plan.shards"),
    ]
    for other, error, field in cases:
        before = other.state_dict()
        with pytest.raises(error, match=field):
            other.load_state_dict(state)
        assert other.state_dict() == before
    with pytest.raises(StateMismatchError, match="num_workers"):
        ShardLoader(_stream(index, topo), num_workers=2).load_state_dict(state)
    with pytest.raises(StateError):
        _stream(index, topo).load_state_dict({**state, "workers": [{"shard": -1, "offset": 0, "yielded": 0}]})
    with pytest.raises(StateError):
        _stream(index, topo).load_state_dict({**state, "version": 99})


def test_a_changed_shard_is_detected_on_resume(tmp_path: Path) -> None:
    paths, index = _shards(tmp_path, 30, 3)
    topo = Topology(world_size=1, rank=0)
    ds = _stream(index, topo)
    it = iter(ds)
    last = next(it)
    state = ds.state_dict()
    it.close()
    with open(last["__url__"], "ab") as f:
        f.write(b"\0" * 10240)  # still a valid tar, but another size
    with pytest.raises(StaleShardError, match="changed"):
        _stream(index, topo).load_state_dict(state)
    with pytest.raises(StaleShardError, match="bytes"):
        list(_stream(index, topo))


def test_epoch_end_and_set_epoch(five: tuple[list[str], Index]) -> None:
    _, index = five
    topo = Topology(world_size=3, rank=2)
    ds = _stream(index, topo)
    first = [s["__key__"] for s in ds]
    state = ds.state_dict()
    assert state["done"] and state["index"] == len(first) == ds.plan().target
    again = _stream(index, topo)
    again.load_state_dict(state)
    again.set_epoch(state["epoch"])  # the restored epoch keeps the restored position
    assert [s["__key__"] for s in again] == []  # restored at its end: nothing is left of it
    assert [s["__key__"] for s in again] == first  # finished, it iterates again from its start
    again.set_epoch(1)
    assert [s["__key__"] for s in again] != first


# ---------------------------------------------------------------- a filesystem that counts


class _CountingFile(io.RawIOBase):
    def __init__(self, path: str) -> None:
        self._f = open(path, "rb", buffering=0)
        self._path = path
        self.size = os.fstat(self._f.fileno()).st_size

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._f.seek(offset, whence)

    def tell(self) -> int:
        return self._f.tell()

    def readinto(self, b: Any) -> int:
        start = self._f.tell()
        n = self._f.readinto(b)
        _Counting.reads.append((self._path, start, start + (n or 0)))
        return n or 0

    def close(self) -> None:
        self._f.close()
        super().close()


class _Counting(AbstractFileSystem):
    """Local files under ``counting://``; records every byte range read."""

    protocol = "counting"
    reads: list[tuple[str, int, int]] = []

    def info(self, path: str, **kw: Any) -> dict[str, Any]:
        st_ = os.stat(self._strip_protocol(path))
        return {"name": path, "size": st_.st_size, "type": "file", "mtime": st_.st_mtime}

    def _open(self, path: str, mode: str = "rb", **kw: Any) -> Any:
        return _CountingFile(self._strip_protocol(path))


fsspec.register_implementation("counting", _Counting, clobber=True)


# ---------------------------------------------------------------- a real gloo job

_JOB = r"""
import datetime, json, sys
import torch.distributed as dist
import webdataset as wds
from wds_pad.index.codec import load_index
from wds_pad.stream.shards import equalize, split_by_node
from wds_pad.stream.shardstream import ShardStream

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
index = load_index(sys.argv[1])
splitter = split_by_node(cp_size=2)          # seed drawn on rank 0 and broadcast
ds = (wds.WebDataset(list(index.urls), nodesplitter=splitter, shardshuffle=False)
      .compose(equalize(index, splitter)).to_tuple("__key__", "__pad__").batched(2))
batches = [list(b[0]) for b in ds]
stream = ShardStream(index, seed=splitter.seed, cp_size=2).to_tuple("__key__", "__pad__").batched(2)
resumable = [list(b[0]) for b in stream]
out = [None] * dist.get_world_size()
dist.all_gather_object(out, {"seed": splitter.seed, "batches": batches})
dist.destroy_process_group()
print(json.dumps({
                  "all": out, "same": resumable == batches}))
"""


@pytest.mark.slow
def test_four_gloo_ranks_with_cp_get_equal_batches(three: tuple[list[str], Index], tmp_path: Path) -> None:
    _, index = three
    results = run_gloo_job(tmp_path, _JOB, 4, args=(str(index.path),))
    gathered = results[0]["all"]
    assert len({g["seed"] for g in gathered}) == 1
    assert len({len(g["batches"]) for g in gathered}) == 1  # no rank waits at the epoch's end
    assert {sum(map(len, g["batches"])) for g in gathered} == {sum(map(len, gathered[0]["batches"]))}
    assert gathered[0]["batches"] == gathered[1]["batches"] and gathered[2]["batches"] == gathered[3]["batches"]
    assert gathered[0]["batches"] != gathered[2]["batches"]
    assert all(r["same"] for r in results)  # ShardStream yields what the drop-in yields


def test_equalize_pairs_with_the_latest_splitter_when_none_is_passed(tmp_path) -> None:
    """The drop-in form from the docs: equalize(index) after split_by_node(...)."""
    import webdataset as wds

    from wds_pad import Topology, build_index, equalize, split_by_node
    from wds_pad.cli.synth import make_image_shards

    urls = make_image_shards(str(tmp_path / "s"), samples=60, shards=5, seed=1)
    index = build_index(urls)
    counts = []
    for rank in range(3):
        splitter = split_by_node(seed=5, topology=Topology(world_size=3, rank=rank))
        stage = equalize(index)
        assert stage.splitter is splitter
        ds = wds.WebDataset(urls, nodesplitter=splitter, shardshuffle=False).compose(stage)
        counts.append(sum(1 for _ in ds))
    assert len(set(counts)) == 1 and counts[0] * 3 >= 60


def test_loading_while_a_shard_stream_iterator_is_open_is_refused(five: tuple[list[str], Index]) -> None:
    from wds_pad.errors import StateError
    from wds_pad.stream.shardstream import ShardLoader

    _, index = five
    topo = Topology(world_size=3, rank=2)
    ds = _stream(index, topo)
    state = ds.state_dict()
    for target in (ds, ShardLoader(ds)):
        it = iter(target)
        next(it)
        before = ds.state_dict()
        with pytest.raises(StateError, match="Load the state before iterating"):
            target.load_state_dict(state)
        assert ds.state_dict() == before
        it.close()
        target.load_state_dict(state)  # closed: now it loads


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(num_workers=1, prefetch_factor=0), r"prefetch_factor must be a positive int .* got 0"),
        (dict(num_workers=0, prefetch_factor=2), r"prefetch_factor=2 needs num_workers > 0"),
        (dict(num_workers=-1), "num_workers must be an int >= 0"),
        (dict(num_workers=1, timeout=-0.5), "timeout must be a finite number of seconds >= 0"),
        (dict(num_workers=0, multiprocessing_context="spawn"), "needs num_workers > 0"),
        (dict(num_workers=1, drop_last=True), "does not take drop_last=True"),
        (dict(num_workers=1, bogus=1), "unknown DataLoader argument"),
    ],
)
def test_shardloader_refuses_dataloader_arguments_torch_checks_late_or_by_assert(
        three: tuple[list[str], Index], kwargs: dict[str, Any], match: str) -> None:
    _, index = three
    with pytest.raises(ConfigError, match=rf"^ShardLoader\b.*{match}"):
        ShardLoader(ShardStream(index, topology=Topology(1, 0), seed=1), **kwargs)


def test_shardloader_with_prefetch_factor_one_streams_everything(three: tuple[list[str], Index]) -> None:
    _, index = three
    loader = ShardLoader(ShardStream(index, topology=Topology(1, 0), seed=1), num_workers=1, prefetch_factor=1)
    assert len(list(loader)) == len(list(ShardStream(index, topology=Topology(1, 0), seed=1)))


def test_splitter_expands_a_glob_and_file_urls_match_the_index(five) -> None:
    """split_by_node expands a pattern in its URL list as build_index does, and an index
    built from file:// URLs is the same as one built from paths (one canonical form)."""
    paths, index = five
    root = os.path.dirname(paths[0])
    topo = Topology(world_size=1, rank=0)
    by_glob = list(_dropin([f"{root}/*.tar"], index, topo))
    assert sorted(s["__key__"] for s in by_glob) == sorted(s["__key__"] for s in _dropin(paths, index, topo))
    from_file_urls = build_index(["file://" + p for p in paths])
    assert list(from_file_urls.urls) == list(index.urls) and from_file_urls.located(index.path).digest == index.digest
    assert len(list(_dropin(paths, from_file_urls, topo))) == len(index)


def test_shard_stream_batches_of_mixed_members_name_the_sample_not_assert(tmp_path: Path) -> None:
    from wds_pad.cli.synth import make_image_shards

    paths = make_image_shards(tmp_path, samples=40, shards=2, seed=3)  # jpg and png mixed
    index = build_index(paths, None, output=str(tmp_path / "index.wdsidx"))
    stream = _stream(index, Topology(1, 0)).decode("pil").batched(40)
    with pytest.raises(ConfigError, match=r"(?s)members.*jpg;png"):
        next(iter(stream))
