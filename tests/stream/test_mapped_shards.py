"""Later epochs of a one-process loop copy local samples out of mappings of their shards
(io/shardmaps.py): the same batches as ``os.pread`` gives, and the same errors."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, Iterator

import pytest

from wds_pad import ReadOptions, Topology
from wds_pad.index.record import Index
from wds_pad.io import shardmaps

from data_helpers import aspect_index, image_index, make_dataset

BATCH = 4


@pytest.fixture(autouse=True)
def fresh(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Nothing seen, nothing kept, mapping on: before and after each test. No copy counts
    as waiting for the disk (a page the kernel dropped from its cache meanwhile would turn
    mapping off: tests/io/test_shardmaps.py tests that rule)."""
    shardmaps._forget()
    monkeypatch.setattr(shardmaps, "faults", lambda: 0)
    yield
    shardmaps._forget()


def _ds(index: Index, **kw: Any) -> Any:
    return make_dataset(index, quiet=True, seed=7, batch_size=BATCH, topology=Topology(1, 0),
                        check_agreement=False, **kw)


def _plain(batches: list[Any]) -> list[Any]:
    return [[{k: bytes(v) if isinstance(v, memoryview) else v for k, v in s.items()} for s in b] for b in batches]


def _epochs(ds: Any, monkeypatch: pytest.MonkeyPatch, epochs: int = 3) -> tuple[list[Any], list[int]]:
    """Each epoch's batches (members as bytes) and how many samples it read with a system call."""
    calls = [0]

    def counted(real: Any) -> Any:
        def call(*a: Any) -> Any:
            calls[0] += 1
            return real(*a)
        return call

    out, reads = [], []
    with monkeypatch.context() as m:
        m.setattr(os, "pread", counted(os.pread))
        m.setattr(os, "preadv", counted(os.preadv))
        for epoch in range(epochs):
            ds.set_epoch(epoch)
            before = calls[0]
            out.append(_plain(list(ds)))
            reads.append(calls[0] - before)
    return out, reads


@pytest.mark.parametrize("zero_copy", [False, True])
def test_later_epochs_copy_out_of_mappings_and_give_the_same_batches(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, zero_copy: bool) -> None:
    index = image_index(tmp_path, samples=96, shards=3, seed=5)
    got, reads = _epochs(_ds(index, zero_copy=zero_copy), monkeypatch)
    assert sorted(shardmaps._MAPS) == sorted(index.urls)
    shardmaps._forget()
    want, pread_reads = _epochs(_ds(index, zero_copy=zero_copy, read_options=ReadOptions(map_local=False)),
                                monkeypatch)
    assert got == want  # the same samples, members, fields and order
    epoch = sum(len(b) for b in got[0])
    assert pread_reads == [epoch] * 3  # map_local=False: a system call a sample, every epoch
    assert reads[0] == epoch  # the first stream of a shard in this process: os.pread
    assert all(0 < n <= BATCH * len(index.urls) for n in reads[1:]), reads  # then only batches that open a shard


def test_a_batch_that_waits_for_the_disk_turns_mapping_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    index = image_index(tmp_path, samples=64, shards=2, seed=6)
    waits = iter(range(10**6))
    monkeypatch.setattr(shardmaps, "faults", lambda: next(waits))  # every copy "waited"
    got, reads = _epochs(_ds(index), monkeypatch)
    assert "waited for the disk" in (shardmaps.stopped() or "")
    assert not shardmaps._MAPS
    epoch = sum(len(b) for b in got[0])
    assert reads[0] == reads[2] == epoch and reads[1] < epoch  # the rest of epoch 1 and all of 2: os.pread
    shardmaps._forget()
    want, _ = _epochs(_ds(index, read_options=ReadOptions(map_local=False)), monkeypatch)
    assert got == want


CUT_SHORT = textwrap.dedent("""
    import os, sys, warnings
    warnings.simplefilter("ignore")
    import wds_pad
    from wds_pad import BucketedWebDataset, Topology
    from wds_pad.io import shardmaps
    index = wds_pad.load_index(sys.argv[1])
    shardmaps.faults = lambda: 0  # no copy counts as waiting for the disk (a cache dropped meanwhile)
    kept = [(open(url, "rb").read(), os.stat(url).st_mtime_ns) for url in index.urls]
    for zero_copy in (False, True):
        shardmaps._forget()
        ds = BucketedWebDataset(index, batch_size=4, seed=7, topology=Topology(1, 0), check_agreement=False,
                                zero_copy=zero_copy)
        list(ds)
        ds.set_epoch(1)
        it = iter(ds)
        next(it), next(it), next(it)
        assert shardmaps._MAPS, "the epoch copies out of mappings"
        for url in index.urls:
            os.truncate(url, os.path.getsize(url) // 2)
        try:
            list(it)
        except wds_pad.WdsPadError as exc:
            print("refused:", type(exc).__name__, ".tar" in str(exc), flush=True)
        for url, (data, mtime) in zip(index.urls, kept):  # restored as indexed for the next round
            with open(url, "r+b") as f:
                f.write(data)
            os.utime(url, ns=(mtime, mtime))
    print("done")
""")


def test_a_shard_cut_short_in_a_mapped_epoch_is_one_clear_error(tmp_path: Path) -> None:
    """Copying a page a cut-short file no longer has would kill the process (SIGBUS): the
    size check before each batch sends it to os.pread, which names the shard. Run in a
    child process, so that a failure is a failed test and not a lost test run."""
    index = image_index(tmp_path, samples=64, shards=2, seed=8)
    out = subprocess.run([sys.executable, "-c", CUT_SHORT, index.path], capture_output=True, text=True,
                         timeout=120, cwd=os.getcwd())
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines() == ["refused: StaleShardError True"] * 2 + ["done"]


def _large_index(directory: Path, producer: str = "webdataset", samples: int = 32, shards: int = 1) -> Index:
    """Samples of ~300 KB (past BIG_SAMPLE: read a member at a time when not mapped)."""
    from wds_pad.cli.synth import make_blob_shards
    from wds_pad.stream.batchread import BIG_SAMPLE

    paths = make_blob_shards(directory / "large", samples=samples, sample_bytes=300_000, shards=shards, seed=4,
                             producer=producer)
    index = aspect_index(paths, directory / "large.wdsidx")
    assert int(index.length.min()) >= BIG_SAMPLE
    return index


def _members_index(directory: Path) -> Index:
    """Samples of one, two and three members, in one shard."""
    import json

    import webdataset as wds

    path = str(directory / "members.tar")
    with wds.TarWriter(path) as w:
        for i in range(40):
            s: dict[str, Any] = {"__key__": f"s{i:04d}", "json": json.dumps({"width": 64 + i % 3, "height": 64}).encode()}
            if i % 3:
                s["bin"] = os.urandom(100 + 37 * i)
            if i % 3 == 2:
                s["txt"] = b"x" * (i + 1)
            w.write(s)
    return aspect_index([path], directory / "members.wdsidx")


@pytest.mark.parametrize(("shards", "member"), [("image", 0), ("image", 1), ("large", 0), ("large", 1),
                                               ("members 1", 0), ("members 3", 0), ("members 3", 2)])
def test_a_header_changed_in_place_under_a_mapping_is_refused(tmp_path: Path, member: int, shards: str) -> None:
    """A mapped epoch slices each payload straight out of the mapping and checks the two
    header fields first: a member's size field rewritten in place (same file size, the
    change stamp put back, so opening the shard finds nothing) is a StaleShardError naming
    the sample, never its payload cut to the new size, for small and large samples."""
    from wds_pad.errors import StaleShardError
    from wds_pad.tar.names import SIZE

    if shards == "image":
        index = image_index(tmp_path, samples=32, shards=1, seed=9)
    else:
        index = _large_index(tmp_path) if shards == "large" else _members_index(tmp_path)
    ds = _ds(index)
    list(ds)  # the first stream: os.pread, and the shard mapped for the next
    later = ds.plan(1).samples[BATCH * 2:].tolist()  # from the next epoch's third batch: its shard mapped by then
    # (_members_index: sample i has 1 member if i % 3 == 0, 3 if i % 3 == 2)
    sample = later[0] if shards in ("image", "large") else next(
        i for i in later if int(index.key(i)[1:]) % 3 == {"members 1": 0, "members 3": 2}[shards])
    url, offset = index.urls[0], int(index.offset[sample])
    with open(url, "rb") as f:
        f.seek(offset)
        data = f.read(int(index.length[sample]))
    heads = [i for i in range(0, len(data), 512) if data[i + 257:i + 262] == b"ustar" and data[i + 156:i + 157] == b"0"]
    head = offset + heads[member]
    mtime = os.stat(url).st_mtime_ns
    with open(url, "r+b") as f:
        f.seek(head + SIZE)
        size = f.read(11)
        f.seek(head + SIZE)
        f.write(b"%011o" % (int(size, 8) - 1))  # one byte shorter: the archive's layout unchanged
    os.utime(url, ns=(mtime, mtime))
    ds.set_epoch(1)
    with pytest.raises(StaleShardError, match=f"sample {index.key(sample)!r} at byte offset {offset} is not as"):
        list(ds)


@pytest.mark.parametrize("zero_copy", [False, True])
@pytest.mark.parametrize("shards", ["large webdataset", "large tarfile-ustar", "members"])
def test_mapped_epochs_of_large_samples_and_other_member_counts_equal_pread(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shards: str, zero_copy: bool) -> None:
    """Large samples (read a member at a time with os.pread) and samples of one and three
    members come out of the mapping from the second epoch on, not a read a sample, and
    equal what os.pread gives."""
    from wds_pad.stream import batchread

    index = _members_index(tmp_path) if shards == "members" else _large_index(
        tmp_path, producer=shards.split()[1], samples=24, shards=2)
    per_member = [0]  # samples read a member at a time (large ones, with os.pread)

    def counted(*a: Any, **kw: Any) -> Any:
        per_member[0] += 1
        return real(*a, **kw)

    real = batchread.slice_sample_at
    monkeypatch.setattr(batchread, "slice_sample_at", counted)
    got, reads = _epochs(_ds(index, zero_copy=zero_copy), monkeypatch)
    mapped_per_member, per_member[0] = per_member[0], 0
    shardmaps._forget()
    want, pread_reads = _epochs(_ds(index, zero_copy=zero_copy, read_options=ReadOptions(map_local=False)),
                                monkeypatch)
    assert got == want
    epoch = sum(len(b) for b in got[0])
    if shards == "members":
        assert {sum(not k.startswith("__") for k in s) for b in got[1] for s in b} == {1, 2, 3}
        assert pread_reads == [epoch] * 3 and reads[0] == epoch
        assert all(0 < n <= BATCH * len(index.urls) for n in reads[1:]), reads
    elif not zero_copy:  # (zero_copy reads a batch into one buffer, out of the mapping too)
        assert per_member[0] == 3 * epoch  # without mappings: every sample, every epoch
        assert epoch <= mapped_per_member <= epoch + 2 * BATCH * len(index.urls)  # then only batches that open a shard
