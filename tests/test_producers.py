"""Shards as real producers write them (wds_pad.cli.synth.write_samples): every producer's
tar holds the samples, webdataset reads them back as written (the oracle), the index's
member table points at every payload's bytes, and the fast read path streams them all
without falling back to parsing headers."""

from __future__ import annotations

import tarfile
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import webdataset as wds

from wds_pad import BucketedWebDataset, Topology
from wds_pad.cli.synth import PRODUCERS, available_producers, make_blob_shards, write_samples
from wds_pad.errors import ConfigError
from wds_pad.index.build import build_index

SORTING = ("webdataset", "wds-shardwriter")  # webdataset's writers sort a sample's members
# tests/conftest.py's ProducerCorpus (.producer, .urls, .shards, .samples): a conftest is
# not importable by name from every test directory (tests/io has its own)
ProducerCorpus = Any


def _payload(sample: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in sample.items() if not k.startswith("__")}


def _archive_members(sample: dict[str, Any], producer: str) -> list[tuple[str, bytes]]:
    members = [(f"{sample['__key__']}.{ext}", v) for ext, v in _payload(sample).items()]
    return sorted(members) if producer in SORTING else members


def _headers(path: str) -> list[tuple[bytes, bytes]]:
    """(typeflag, magic) of every header block, walking the tar's own layout."""
    data, at, out = Path(path).read_bytes(), 0, []
    while at + 512 <= len(data) and data[at : at + 512] != bytes(512):
        block = data[at : at + 512]
        size = int(block[124:136].rstrip(b"\0 ") or b"0", 8)
        out.append((block[156:157], block[257:265]))
        at += 512 + (size + 511) // 512 * 512
    return out


@pytest.fixture(scope="module")
def corpus_index(producer_corpus: ProducerCorpus) -> Any:
    return build_index(producer_corpus.urls, "aspect:width,height")


def test_corpus_covers_the_header_forms(producer_corpus: ProducerCorpus) -> None:
    keys = [s["__key__"] for s in producer_corpus.samples]
    assert len(producer_corpus.urls) == 3 and len(keys) == 90 == len(set(keys))
    assert max(len(k.encode()) for k in keys) > 100
    assert any("." in k.rsplit("/", 1)[0] for k in keys)  # dotted directories
    assert {len(_payload(s)) for s in producer_corpus.samples} == {2, 3}
    sizes = [len(v) for s in producer_corpus.samples for v in _payload(s).values()]
    assert min(sizes) == 0 and sum(n > 256 * 1024 for n in sizes) >= 3
    if producer_corpus.producer in ("webdataset", "wds-shardwriter", "tarfile-pax", "gnutar-posix"):
        assert any(not k.isascii() for k in keys)
    if producer_corpus.producer not in ("tarfile-ustar", "gnutar-ustar"):
        assert max(len(k.encode()) for k in keys) > 255


def test_tar_holds_the_members(producer_corpus: ProducerCorpus) -> None:
    for url, shard in zip(producer_corpus.urls, producer_corpus.shards):
        with tarfile.open(url) as tf:
            got = [(m.name, tf.extractfile(m).read())  # type: ignore[union-attr]
                   for m in tf.getmembers() if m.isfile()]
        want = [m for s in shard for m in _archive_members(s, producer_corpus.producer)]
        assert [n for n, _ in got] == [n for n, _ in want]
        assert got == want


def test_webdataset_reads_the_samples_as_written(producer_corpus: ProducerCorpus) -> None:
    got = list(wds.WebDataset(producer_corpus.urls, shardshuffle=False, empty_check=False))
    assert [s["__url__"] for s in got] == [u for u, sh in zip(producer_corpus.urls, producer_corpus.shards)
                                           for _ in sh]
    assert [{k: v for k, v in s.items() if k == "__key__" or not k.startswith("__")} for s in got] \
        == producer_corpus.samples


def test_member_table_points_at_every_payload(producer_corpus: ProducerCorpus, corpus_index: Any) -> None:
    index = corpus_index
    want = {(u, s["__key__"]): s for u, sh in zip(producer_corpus.urls, producer_corpus.shards) for s in sh}
    assert len(index) == len(want) and index.has_members
    assert index.members_missing() == (0, "")
    files = {u: Path(u).read_bytes() for u in producer_corpus.urls}
    ms = index.arrays["member_start"]
    seen = set()
    for i in range(len(index)):
        url, key = index.url(i), index.key(i)
        sample = want[(url, key)]
        seen.add((url, key))
        lo, hi = int(ms[i]), int(ms[i + 1])
        at = np.arange(lo, hi, dtype=np.int64)
        offsets = index.member_offsets(at, np.array([hi - lo], np.int64))
        sizes = index.arrays["member_size"][at]
        exts = [index.exts[int(e)] for e in index.arrays["member_ext"][at]]
        assert exts == [n.rsplit(".", 1)[1] for n, _ in _archive_members(sample, producer_corpus.producer)], key
        start = int(index.offset[i])
        assert int(offsets.max()) + int(sizes[int(offsets.argmax())]) <= int(index.length[i])
        for ext, off, size in zip(exts, offsets, sizes):
            assert files[url][start + int(off) : start + int(off) + int(size)] == sample[ext], (key, ext)
    assert seen == set(want)


@pytest.mark.parametrize("batch_size", [1, 8])
def test_stream_yields_every_sample_once(producer_corpus: ProducerCorpus, corpus_index: Any, batch_size: int) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ds = BucketedWebDataset(corpus_index, batch_size=batch_size, seed=5, pad="none",
                                topology=Topology(world_size=1, rank=0), check_agreement=False)
        got = [s for batch in ds for s in batch]
    want = {(u, s["__key__"]): s for u, sh in zip(producer_corpus.urls, producer_corpus.shards) for s in sh}
    assert sorted((s["__url__"], s["__key__"]) for s in got) == sorted(want)  # each exactly once
    for s in got:
        assert _payload(s) == _payload(want[(s["__url__"], s["__key__"])]), s["__key__"]
    assert ds.read_stats is not None
    assert ds.read_stats.exact_batches == 0  # every batch went the member-table way


def test_producer_writes_reproducible_bytes(producer_corpus: ProducerCorpus, tmp_path: Path) -> None:
    again = write_samples(tmp_path, producer_corpus.shards, producer_corpus.producer)
    assert [Path(p).name for p in again] == [Path(p).name for p in producer_corpus.urls]
    assert [Path(p).read_bytes() for p in again] == [Path(p).read_bytes() for p in producer_corpus.urls]
    assert sorted(p.name for p in tmp_path.iterdir()) == [Path(p).name for p in again]  # no temporaries


def test_available_producers() -> None:
    available = available_producers()
    assert available == tuple(p for p in PRODUCERS if p in available)
    assert {"webdataset", "wds-shardwriter", "tarfile-pax", "tarfile-gnu", "tarfile-ustar"} <= set(available)


def test_blob_shards_headers_by_producer(tmp_path: Path) -> None:
    pax = make_blob_shards(tmp_path / "pax", samples=20, sample_bytes=100, shards=2, producer="webdataset")
    ustar = make_blob_shards(tmp_path / "ustar", samples=20, sample_bytes=100, shards=2, producer="tarfile-ustar")
    for path in pax:
        flags = [t for t, _ in _headers(path)]
        assert flags == [b"x", b"0"] * (len(flags) // 2)  # a pax header before every member
    for path in ustar:
        assert set(_headers(path)) == {(b"0", b"ustar\x0000")}  # plain ustar, nothing else
    same = lambda paths: [[(k, _payload(s)) for s in wds.WebDataset(p, shardshuffle=False)  # noqa: E731
                           for k in [s["__key__"]]] for p in paths]
    assert same(pax) == same(ustar)


def test_unknown_producer_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown producer 'zip'.*webdataset, wds-shardwriter, tarfile-pax"):
        write_samples(tmp_path, [[{"__key__": "a", "bin": b"x"}]], "zip")
    with pytest.raises(ConfigError, match="unknown producer"):
        make_blob_shards(tmp_path, samples=4, sample_bytes=100, shards=1, producer="tar")
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    ("sample", "needle"),
    [
        ({"bin": b"x"}, "non-empty str '__key__'"),
        ({"__key__": "a", "bin": "text"}, "member 'bin' must be bytes"),
        ({"__key__": "a"}, "at least one member"),
        ({"__key__": "dir/a.b", "bin": b"x"}, "dot in the key's last path part"),
    ],
)
def test_bad_samples_are_config_errors(tmp_path: Path, sample: dict, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        write_samples(tmp_path, [[sample]], "tarfile-pax")


@pytest.mark.parametrize("producer", [p for p in ("tarfile-ustar", "gnutar-ustar") if p in available_producers()])
def test_ustar_refuses_a_path_it_cannot_store(tmp_path: Path, producer: str) -> None:
    key = "x" * 300  # no "/" to split at, and over 255 bytes anyway
    with pytest.raises(ConfigError, match=producer):
        write_samples(tmp_path, [[{"__key__": key, "bin": b"x"}]], producer)
    assert not [p for p in tmp_path.iterdir() if p.suffix == ".tar"]
