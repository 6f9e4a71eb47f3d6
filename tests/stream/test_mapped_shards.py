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

from data_helpers import image_index, make_dataset

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


@pytest.mark.parametrize("member", [0, 1])
def test_a_header_changed_in_place_under_a_mapping_is_refused(tmp_path: Path, member: int) -> None:
    """A mapped epoch slices each payload straight out of the mapping and checks the two
    header fields first: a member's size field rewritten in place (same file size, the
    change stamp put back, so opening the shard finds nothing) is a StaleShardError naming
    the sample, never its payload cut to the new size."""
    from wds_pad.errors import StaleShardError
    from wds_pad.tar.names import SIZE

    index = image_index(tmp_path, samples=32, shards=1, seed=9)
    ds = _ds(index)
    list(ds)  # the first stream: os.pread, and the shard mapped for the next
    sample = int(ds.plan(1).samples[BATCH * 2])  # in the next epoch's third batch: its shard mapped by then
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
