"""The batch-wise fast path (stream/batchread.py): the same samples as the exact path,
the same stale-shard and bad-sample behaviour, and Plan.batches (its chunked plan)."""

from __future__ import annotations

import io
import json
import os
import re
import tarfile
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import webdataset as wds

from wds_pad import BucketedWebDataset, StaleShardError, Topology
from wds_pad.index.build import build_index
from wds_pad.index.layout import MEMBER_ARRAYS
from wds_pad.stream import batchcache, batchread


def _add(tf: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mtime = 0
    tf.addfile(info, io.BytesIO(data))


def _shard(path: Path, start: int, count: int, kind: str) -> str:
    """A shard of ``count`` samples with the oddities ``kind`` names."""
    fmt = tarfile.PAX_FORMAT if kind == "pax" else tarfile.GNU_FORMAT
    with tarfile.open(path, "w", format=fmt) as tf:
        for i in range(start, start + count):
            key = f"{i:06d}"
            if kind == "long" and i % 3 == 0:
                key = "d" * 120 + "/" + key  # a GNU long name
            if kind == "pax" and i % 4 == 0:
                key = f"p\u00e9-{i:06d}"  # non-ASCII: a pax path record
            ext = "png" if kind == "mixed" and i % 2 else "jpg"
            if not (kind == "missing" and i % 5 == 0):
                _add(tf, f"{key}.{ext}", os.urandom(100 + (i * 37) % 3000))
            if kind == "meta" and i % 7 == 0:
                _add(tf, f"{key}.__meta__", b"x")  # skipped by webdataset, inside the sample
            _add(tf, f"{key}.json", json.dumps({"width": 4, "height": 3 if i % 2 else 4, "i": i}).encode())
    return str(path)


@pytest.fixture(params=["plain", "pax", "long", "mixed", "missing", "meta"])
def shards(request: Any, tmp_path: Path) -> list[str]:
    return [_shard(tmp_path / f"s{k}.tar", 40 * k, 40, request.param if k else "plain") for k in range(3)]


def _dataset(index: Any, **kw: Any) -> BucketedWebDataset:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return BucketedWebDataset(index, batch_size=8, seed=3, topology=Topology(world_size=1, rank=0),
                                  check_agreement=False, **kw)


def _exact(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(batchread.BatchReader, "read", lambda self, batch: None)


def _counting(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    used: list[int] = []
    real = batchread.BatchReader.read

    def read(self: Any, batch: Any) -> Any:
        out = real(self, batch)
        used.append(out is not None)
        return out

    monkeypatch.setattr(batchread.BatchReader, "read", read)
    return used


def _as_plain(batches: list[Any]) -> list[list[list[tuple[str, Any]]]]:
    return [[list(s.items()) for s in b] for b in batches]


def test_fast_path_equals_exact_path(shards: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    index = build_index(shards, "aspect:width,height", output=str(tmp_path / "i.wdsidx"))
    assert index.has_members
    used = _counting(monkeypatch)
    ds = _dataset(str(tmp_path / "i.wdsidx"))
    fast = list(ds)
    assert all(used)  # every header form (pax, GNU long names, metadata members) goes the fast way
    assert ds.read_stats.exact_batches == ds.read_stats.exact_samples == 0
    monkeypatch.undo()
    _exact(monkeypatch)
    exact = list(_dataset(str(tmp_path / "i.wdsidx")))
    assert _as_plain(fast) == _as_plain(exact)  # same dicts, same key order
    assert all(type(b) is list for b in fast)
    ref = {(u, k): s for u, k, s in ((s["__url__"], s["__key__"], s) for s in wds.WebDataset(shards, shardshuffle=False))}
    for b in fast:
        for s in b:
            want = ref[(s["__url__"], s["__key__"])]
            assert {k: v for k, v in s.items() if not k.startswith("__")} == \
                {k: v for k, v in want.items() if not k.startswith("__")}


def test_index_without_member_table_streams(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    urls = [_shard(tmp_path / f"s{k}.tar", 40 * k, 40, "plain") for k in range(2)]
    index = build_index(urls, "aspect:width,height")
    with_members = list(_dataset(index))
    for k in MEMBER_ARRAYS:
        index.arrays.pop(k)
    assert not index.has_members
    used = _counting(monkeypatch)
    assert _as_plain(list(_dataset(index))) == _as_plain(with_members)
    assert not any(used)


def test_exact_path_batches_are_counted_in_read_stats(tmp_path: Path) -> None:
    urls = [_shard(tmp_path / f"s{k}.tar", 40 * k, 40, "plain") for k in range(2)]
    index = build_index(urls, "aspect:width,height")
    for k in MEMBER_ARRAYS:
        index.arrays.pop(k)
    ds = _dataset(index)
    batches = list(ds)
    assert ds.read_stats.exact_batches == len(batches) and ds.read_stats.exact_samples == len(index)


def test_a_bug_on_the_fast_path_is_not_taken_for_a_fallback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    urls = [_shard(tmp_path / f"s{k}.tar", 40 * k, 40, "plain") for k in range(2)]
    index = build_index(urls, "aspect:width,height")

    def broken(self: Any, batch: Any, work: Any) -> Any:
        raise TypeError("a bug")

    monkeypatch.setattr(batchread.BatchReader, "_read", broken)
    with pytest.raises(TypeError, match="a bug"):
        list(_dataset(index))


@pytest.mark.parametrize("batch_size", [1, 3, 16])
def test_member_work_is_prepared_once_per_chunk_of_batches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            batch_size: int) -> None:
    """A batch of one sample pays no numpy work of its own: the member work of a chunk of
    plan batches (at least CHUNK_SAMPLES samples' worth) is computed together."""
    urls = [_shard(tmp_path / f"s{k}.tar", 40 * k, 40, "mixed") for k in range(3)]
    index = build_index(urls, "aspect:width,height")
    monkeypatch.setattr(batchcache, "CHUNK_SAMPLES", 40)
    monkeypatch.setattr(batchcache, "CHUNK", 2)
    calls: list[int] = []
    real = batchread.BatchReader._prepare

    def prepare(self: Any, ix: Any, group: list[Any]) -> None:
        calls.append(len(group))
        real(self, ix, group)

    monkeypatch.setattr(batchread.BatchReader, "_prepare", prepare)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ds = BucketedWebDataset(index, batch_size=batch_size, seed=3, topology=Topology(world_size=1, rank=0),
                                check_agreement=False)
    got = list(ds)
    chunk = batchcache.chunk_batches(batch_size)
    assert chunk == max(2, 40 // batch_size)
    assert len(calls) == -(-len(got) // chunk) and sum(calls) == len(got)
    assert ds.read_stats.exact_batches == 0
    assert [[s["__key__"] for s in b] for b in got] == [[index.key(int(i)) for i in b.samples] for b in ds.plan()]


@pytest.mark.parametrize("step, run", [(1, 1), (2, 1), (2, 4), (3, 2), (4, 4), (8, 2)])
def test_a_stream_s_chunks_hold_exactly_its_batches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     step: int, run: int) -> None:
    """BatchCache.get(plan, j) is plan[j] for every batch a stream takes (every step-th run
    of run batches), from any first batch, and a chunk holds only that stream's batches,
    whether it is computed in one pass over every stream's runs or one per place in a run."""
    urls = [_shard(tmp_path / f"s{k}.tar", 40 * k, 40, "mixed") for k in range(3)]
    index = build_index(urls, "aspect:width,height")
    monkeypatch.setattr(batchcache, "CHUNK_SAMPLES", 8)
    monkeypatch.setattr(batchcache, "CHUNK", 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = BucketedWebDataset(index, batch_size=2, seed=3, topology=Topology(world_size=1, rank=0),
                                  check_agreement=False).plan()
    for first in (0, 1, run + 1):
        for wid in range(step):
            taken = [j for c, j in enumerate(range(first, len(plan))) if (c // run) % step == wid]
            cache = batchcache.BatchCache(step, None, run)
            for j in taken:
                got = cache.get(plan, j)
                assert (got.index, got.samples.tolist(), got.pad.tolist()) == \
                       (plan[j].index, plan[j].samples.tolist(), plan[j].pad.tolist())
                assert set(cache._batches) <= set(taken)  # nothing another stream takes


@pytest.mark.parametrize("form", ["ustar-prefix", "pax-non-ascii", "pax-long", "gnu-long"])
def test_fast_path_reads_each_header_form(tmp_path: Path, form: str) -> None:
    """The header before each payload names the sample in each form's own way
    (``wds_pad.tar.names``, tested in tests/tar/test_names.py): every batch is read
    through the member table."""
    fmt = {"ustar-prefix": tarfile.USTAR_FORMAT, "gnu-long": tarfile.GNU_FORMAT}.get(form, tarfile.PAX_FORMAT)
    path = tmp_path / "s.tar"
    keys = []
    with tarfile.open(path, "w", format=fmt) as tf:
        for i in range(12):
            key = {"ustar-prefix": "dir.v1/" + "p" * 90 + f"/k{i:03d}", "pax-non-ascii": f"caf\u00e9-{i:03d}",
                   "pax-long": "l" * 130 + f"{i:03d}", "gnu-long": "g" * 130 + f"{i:03d}"}[form]
            keys.append(key)
            _add(tf, f"{key}.bin", os.urandom(50 + i))
            _add(tf, f"{key}.json", json.dumps({"width": 4, "height": 3}).encode())
    index = build_index([str(path)], "aspect:width,height")
    ds = BucketedWebDataset(index, batch_size=4, seed=3, topology=Topology(world_size=1, rank=0),
                            check_agreement=False)
    assert sorted(s["__key__"] for b in ds for s in b) == sorted(keys)
    assert ds.read_stats.exact_batches == 0


def test_stale_shard_raises_on_fast_path(tmp_path: Path) -> None:
    urls = [_shard(tmp_path / f"s{k}.tar", 40 * k, 40, "plain") for k in range(2)]
    build_index(urls, "aspect:width,height", output=str(tmp_path / "i.wdsidx"))
    os.utime(urls[1], (1, 1))
    with pytest.raises(StaleShardError, match="changed since it was indexed"):
        list(_dataset(str(tmp_path / "i.wdsidx")))


def _corrupt_first_name(url: str, index: Any) -> str:
    """Overwrite the first header name of a sample of ``url`` in place (size and mtime kept)."""
    si = index.urls.index(url)
    i = int(np.flatnonzero(index.shard == si)[0])
    st = os.stat(url)
    with open(url, "r+b") as f:
        f.seek(int(index.offset[i]))
        f.write(b"zz")
    os.utime(url, ns=(st.st_atime_ns, st.st_mtime_ns))
    return index.key(i)


def test_bad_sample_raises_or_is_substituted_on_fast_path(tmp_path: Path) -> None:
    urls = [_shard(tmp_path / f"s{k}.tar", 40 * k, 40, "plain") for k in range(2)]
    index = build_index(urls, "aspect:width,height", output=str(tmp_path / "i.wdsidx"))
    key = _corrupt_first_name(urls[0], index)
    with pytest.raises(StaleShardError, match=key):
        list(_dataset(str(tmp_path / "i.wdsidx")))
    ds = _dataset(str(tmp_path / "i.wdsidx"), handler=lambda exc: True)
    batches = list(ds)
    assert ds.counters.substituted == 1
    subs = [s for b in batches for s in b if "__substitute_for__" in s]
    assert [s["__substitute_for__"] for s in subs] == [key]
    assert sum(len(b) for b in batches) == len(index)


def test_plan_batches_equal_plan_items(tmp_path: Path) -> None:
    urls = [_shard(tmp_path / f"s{k}.tar", 40 * k, 40, "plain") for k in range(3)]
    plan = _dataset(build_index(urls, "aspect:width,height")).plan()
    for lo, hi, step in ((0, len(plan), 1), (1, len(plan), 2), (2, len(plan) + 5, 3), (4, 2, 1)):
        got = plan.batches(lo, hi, step)
        want = [plan[i] for i in range(lo, min(hi, len(plan)), step)]
        assert [(b.index, b.step, b.bucket, b.dataset, b.epoch) for b in got] == \
            [(b.index, b.step, b.bucket, b.dataset, b.epoch) for b in want]
        assert all(np.array_equal(a.samples, b.samples) and np.array_equal(a.pad, b.pad) for a, b in zip(got, want))


def test_workers_deliver_the_fast_path_batches(tmp_path: Path) -> None:
    from wds_pad import Loader

    urls = [_shard(tmp_path / f"s{k}.tar", 40 * k, 40, "mixed") for k in range(3)]
    build_index(urls, "aspect:width,height", output=str(tmp_path / "i.wdsidx"))
    inline = list(Loader(_dataset(str(tmp_path / "i.wdsidx")), num_workers=0))
    workers = list(Loader(_dataset(str(tmp_path / "i.wdsidx")), num_workers=2))
    assert _as_plain(workers) == _as_plain(inline)
    assert len(inline) == len(_dataset(str(tmp_path / "i.wdsidx")))


def test_loader_widens_the_workers_pipe() -> None:
    import fcntl
    import types

    from wds_pad.stream.loader import _PIPE_BYTES, _widen_pipe

    r, w = os.pipe()
    try:
        fake = types.SimpleNamespace(_worker_result_queue=types.SimpleNamespace(
            _reader=types.SimpleNamespace(fileno=lambda: r)))
        _widen_pipe(fake)
        assert fcntl.fcntl(r, getattr(fcntl, "F_GETPIPE_SZ", 1032)) == _PIPE_BYTES
        _widen_pipe(object())  # another torch: nothing happens
    finally:
        os.close(r)
        os.close(w)


def test_large_local_samples_need_no_read_ahead_threads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    from wds_pad import ReadOptions
    from wds_pad.stream import fetch as fetch_mod

    monkeypatch.setattr(fetch_mod, "BIG_SAMPLE", 1)  # every sample "large" on the exact path
    _exact(monkeypatch)
    urls = [_shard(tmp_path / f"s{k}.tar", 40 * k, 40, "plain") for k in range(2)]
    index = build_index(urls, "aspect:width,height")
    before = threading.active_count()
    assert sum(len(b) for b in _dataset(index, read_options=ReadOptions(local_threads=2))) == len(index)
    assert threading.active_count() == before


# -- the fast path on shards as every real producer writes them (tests/conftest.py) ----------
def _corpus_index(corpus: Any, tmp_path: Path) -> Any:
    """A private copy of the corpus's shards (tests here damage them) and its index."""
    import shutil

    urls = []
    for url in corpus.urls:
        urls.append(str(tmp_path / Path(url).name))
        shutil.copy2(url, urls[-1])
    return build_index(urls, "aspect:width,height", output=str(tmp_path / "c.wdsidx"))


def _corpus_ds(index: Any, **kw: Any) -> BucketedWebDataset:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return BucketedWebDataset(index, batch_size=4, seed=3, topology=Topology(world_size=1, rank=0),
                                  check_agreement=False, **kw)


def test_every_producer_fast_path_equals_exact_path_inline_and_in_workers(
        producer_corpus: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from wds_pad import Loader

    index = _corpus_index(producer_corpus, tmp_path)
    ds = _corpus_ds(index)
    fast = list(ds)
    assert ds.read_stats.exact_batches == 0 and len(fast) == len(ds)
    workers = list(Loader(_corpus_ds(index), num_workers=2))
    assert _as_plain(workers) == _as_plain(fast)
    _exact(monkeypatch)
    assert _as_plain(list(_corpus_ds(index))) == _as_plain(fast)


def test_every_producer_damaged_member_header_raises_or_is_substituted(producer_corpus: Any, tmp_path: Path) -> None:
    """Bit rot in the header before a sample's first payload (size and mtime kept): the
    fast path refuses the batch and the exact path names the sample, or substitutes it."""
    index = _corpus_index(producer_corpus, tmp_path)
    victim = int(_corpus_ds(index).plan()[2].samples[0])
    url = index.url(victim)
    head = int(index.member_offsets(np.array([int(index.arrays["member_start"][victim])]), np.array([1]))[0]) - 512
    st = os.stat(url)
    with open(url, "r+b") as f:
        f.seek(int(index.offset[victim]) + head)
        f.write(b"\xff\xfe")
    os.utime(url, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(StaleShardError, match=re.escape(repr(index.key(victim)))):
        list(_corpus_ds(index))
    ds = _corpus_ds(index, handler=lambda exc: True)
    hits = sum(int((b.samples == victim).sum()) for b in ds.plan())  # with its padded copies
    batches = list(ds)
    assert ds.counters.substituted == hits >= 1 and ds.read_stats.exact_batches >= 1
    assert [s["__substitute_for__"] for b in batches for s in b if "__substitute_for__" in s] == [index.key(victim)] * hits


def test_every_producer_rewritten_shard_raises_on_the_fast_path(producer_corpus: Any, tmp_path: Path) -> None:
    index = _corpus_index(producer_corpus, tmp_path)
    os.utime(index.urls[1], (1, 1))
    with pytest.raises(StaleShardError, match="changed since it was indexed"):
        list(_corpus_ds(index))
