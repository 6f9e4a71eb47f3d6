"""The index file format: round trip, memory mapping, refusal of damaged files, lookups."""

from __future__ import annotations

import json
import mmap
import os
import pickle
import struct
import subprocess
import sys
import zlib

import fsspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from wds_pad.errors import IndexFormatError, ReadError
from wds_pad.index import codec
from wds_pad.index.codec import load_index
from wds_pad.index.layout import FORMAT_VERSION, MAGIC
from wds_pad.index.record import Index, ShardInfo
from wds_pad.index.rows import make_index
from wds_pad.index.output import write_index
from wds_pad.core.dataset import Dataset, IdRange, bucket_order


def small_index(name: str = "toy") -> Index:
    """Seven samples over two shards, three buckets given out of canonical order."""
    shards = [ShardInfo("/data/a.tar", 10240, "mtime=1.0", 4), ShardInfo("/data/b.tar", 8192, "mtime=2.0", 3)]
    bucket_keys = ["b", "a", "c"]  # first-seen order; make_index must sort them
    rows = {
        "shard": np.array([0, 0, 0, 0, 1, 1, 1]),
        "offset": np.array([0, 1536, 3072, 4608, 0, 2048, 4096]),
        "length": np.array([1536, 1536, 1536, 2048, 2048, 2048, 1024]),
        "bucket": np.array([0, 1, 0, 2, 1, 1, 0]),  # indices into bucket_keys
        "exts": np.array([3, 3, 1, 3, 2, 3, 3], dtype=np.uint64),
    }
    keys = ["k0", "k1", "k2", "dir/k3", "é4", "k5", "k6"]
    return make_index(shards, rows, bucket_keys, keys, bucket_by={"kind": "json", "field": "x"},
                      exts=["jpg", "json"], excluded={"samples": [], "shards": [], "count": 0}, name=name)


def test_make_index_orders_buckets_canonically_and_remaps_rows() -> None:
    idx = small_index()
    assert idx.buckets == ("a", "b", "c")
    # rows grouped by bucket (canonical order), shard then byte order inside a bucket
    assert [idx.buckets[b] for b in idx.bucket] == ["a", "a", "a", "b", "b", "b", "c"]
    assert [idx.key(i) for i in range(len(idx))] == ["k1", "é4", "k5", "k0", "k2", "k6", "dir/k3"]
    assert idx.bucket_offsets.tolist() == [0, 3, 6, 7]
    assert idx.bucket_counts() == {"a": 3, "b": 3, "c": 1}
    assert idx.bucket_bytes() == {"a": 1536 + 2048 + 2048, "b": 1536 + 1536 + 1024, "c": 2048}
    assert list(idx.buckets) == sorted(idx.buckets, key=bucket_order)


def test_lookups_keys_urls_exts() -> None:
    idx = small_index()
    by_key = {idx.key(i): i for i in range(len(idx))}
    assert idx.url(by_key["dir/k3"]) == "/data/a.tar" and idx.url(by_key["é4"]) == "/data/b.tar"
    assert int(idx.offset[by_key["k5"]]) == 2048 and int(idx.length[by_key["dir/k3"]]) == 2048
    assert idx.sample_exts(by_key["k0"]) == ("jpg", "json")
    assert idx.sample_exts(by_key["k2"]) == ("jpg",)
    assert idx.sample_exts(by_key["é4"]) == ("json",)
    urls, keys = idx.describe_samples(np.array([by_key["k6"], by_key["k0"]]))
    assert urls == ["/data/b.tar", "/data/a.tar"] and keys == ["k6", "k0"]


def test_bucket_samples_and_to_dataset() -> None:
    idx = small_index()
    got = idx.bucket_samples()
    assert list(got) == ["a", "b", "c"]
    for key, ids in got.items():
        expected = [i for i in range(len(idx)) if idx.buckets[idx.bucket[i]] == key]
        assert ids.dtype == np.int64 and ids.tolist() == expected
    ds = idx.to_dataset(repeats=2, weight=0.5)
    assert isinstance(ds, Dataset)
    assert ds.name == "toy" and ds.repeats == 2 and ds.weight == 0.5
    assert {k: v.tolist() for k, v in ds.buckets.items()} == {k: v.tolist() for k, v in got.items()}
    assert all(isinstance(v, IdRange) for v in ds.buckets.values())  # O(buckets): no id is read
    assert idx.to_dataset(name="other").name == "other"


def test_round_trip_preserves_everything(tmp_path) -> None:
    idx = small_index()
    path = write_index(idx, str(tmp_path / "toy.wdsidx"))
    back = load_index(path)
    assert back.digest == idx.digest and back.name == "toy" and back.path == path
    assert back.shards == idx.shards and back.buckets == idx.buckets and back.exts == idx.exts
    assert dict(back.bucket_by) == dict(idx.bucket_by) and dict(back.excluded) == dict(idx.excluded)
    for k, arr in idx.arrays.items():
        assert back.arrays[k].dtype == arr.dtype
        np.testing.assert_array_equal(back.arrays[k], arr)
    # header fields as documented in docs/indexing.md
    raw = open(path, "rb").read()
    magic, version, crc, hlen = struct.unpack_from("<8sIIQ", raw, 0)
    header = json.loads(raw[24 : 24 + hlen])
    assert magic == MAGIC and version == FORMAT_VERSION and crc == zlib.crc32(raw[24 : 24 + hlen])
    assert set(header) == {"format", "version", "name", "samples", "buckets", "bucket_by",
                           "exts", "digest", "sections"}
    assert header["samples"] == 7 and header["format"] == "wds_pad.index"
    assert sorted(header["sections"], key=lambda k: header["sections"][k]["offset"]) == ["bucket_offsets", "shard", "offset", "length", "exts", "key_offsets",
                                        "keys", "shards", "excluded"]
    base = -(-(24 + hlen) // 64) * 64
    for k, spec in header["sections"].items():
        assert (base + spec["offset"]) % 64 == 0  # every array 64-byte aligned


def test_int_bucket_keys_round_trip_as_ints(tmp_path) -> None:
    shards = [ShardInfo("/x.tar", 2048, "", 2)]
    rows = {"shard": np.zeros(2, int), "offset": np.array([0, 512]), "length": np.array([512, 512]),
            "bucket": np.array([0, 1]), "exts": np.ones(2, np.uint64)}
    idx = make_index(shards, rows, [10, 2], ["a", "b"], bucket_by={"kind": "callable"}, exts=["txt"])
    back = load_index(write_index(idx, str(tmp_path / "i.wdsidx")))
    assert back.buckets == (2, 10) and back.bucket_counts() == {2: 1, 10: 1}


def _mmap_base(arr: np.ndarray) -> object:
    base = arr
    while base is not None and not isinstance(base, mmap.mmap):
        base = getattr(base, "obj", None) if isinstance(base, memoryview) else getattr(base, "base", None)
    return base


def test_local_load_is_memory_mapped_not_copied(tmp_path) -> None:
    path = write_index(small_index(), str(tmp_path / "toy.wdsidx"))
    back = load_index(path)
    for k, arr in back.arrays.items():
        assert isinstance(_mmap_base(arr), mmap.mmap), k  # a view over the mapped file
        assert not arr.flags.writeable and not arr.flags.owndata
    # the pages are the file's: the view sees what is on disk at its offset
    raw = open(path, "rb").read()
    offs = back.arrays["offset"]
    addr = raw.find(offs.tobytes())
    assert addr > 0 and addr % 64 == 0


def test_memory_filesystem_write_and_load() -> None:
    fs = fsspec.filesystem("memory")
    url = "memory://wds_pad_test_index/toy.wdsidx"
    try:
        assert write_index(small_index(), url) == url
        back = load_index(url)
        assert back.digest == small_index().digest and len(back) == 7
        assert back.key(6) == "dir/k3"
    finally:
        fs.rm("/wds_pad_test_index", recursive=True)


@pytest.mark.parametrize("where", ["file", "memory"])
def test_a_loaded_index_pickles_whole_for_another_process(tmp_path, where) -> None:
    """Its sections are parsed on first use; a pickle (what a spawned worker receives)
    carries them parsed, and the copy has the same digest, rows and tables."""
    url = str(tmp_path / "toy.wdsidx") if where == "file" else f"memory://wds_pad_pickle_{tmp_path.name}/toy.wdsidx"
    try:
        loaded = load_index(write_index(small_index(), url))
        copy = pickle.loads(pickle.dumps(loaded))
    finally:
        if where == "memory":
            fsspec.filesystem("memory").rm(f"/wds_pad_pickle_{tmp_path.name}", recursive=True)
    assert copy.shards == small_index().shards and dict(copy.excluded) == dict(small_index().excluded)
    assert copy.digest == loaded.digest == copy.compute_digest() and copy.path == url
    assert [copy.key(i) for i in range(len(copy))] == [loaded.key(i) for i in range(len(loaded))]
    for k, arr in loaded.arrays.items():
        np.testing.assert_array_equal(copy.arrays[k], arr)


# -- refusals -----------------------------------------------------------------------------
@pytest.fixture()
def index_bytes(tmp_path):
    path = write_index(small_index(), str(tmp_path / "good.wdsidx"))
    return open(path, "rb").read()


def _write(tmp_path, data: bytes) -> str:
    path = str(tmp_path / "bad.wdsidx")
    with open(path, "wb") as f:
        f.write(data)
    return path


def test_refuses_wrong_version(tmp_path, index_bytes) -> None:
    data = bytearray(index_bytes)
    struct.pack_into("<I", data, 8, FORMAT_VERSION + 1)
    path = _write(tmp_path, bytes(data))
    with pytest.raises(IndexFormatError, match=rf"format version {FORMAT_VERSION + 1}.*reads version {FORMAT_VERSION}"):
        load_index(path)


def test_refuses_bad_magic(tmp_path, index_bytes) -> None:
    path = _write(tmp_path, b"NOTANIDX" + index_bytes[8:])
    with pytest.raises(IndexFormatError, match="not a wds_pad index \\(bad magic\\)"):
        load_index(path)


@pytest.mark.parametrize("cut", ["prefix", "header", "arrays"])
def test_refuses_truncated_file(tmp_path, index_bytes, cut) -> None:
    hlen = struct.unpack_from("<Q", index_bytes, 16)[0]
    size = {"prefix": 10, "header": 24 + hlen // 2, "arrays": len(index_bytes) - 100}[cut]
    path = _write(tmp_path, index_bytes[:size])
    want = {"prefix": "not a wds_pad index", "header": "truncated header", "arrays": "is truncated"}[cut]
    with pytest.raises(IndexFormatError, match=want) as info:
        load_index(path)
    assert path in str(info.value)


def test_refuses_damaged_header(tmp_path, index_bytes) -> None:
    data = bytearray(index_bytes)
    pos = index_bytes.index(b'"toy"')
    data[pos + 1] = ord("x")  # still JSON, but the crc no longer matches
    path = _write(tmp_path, bytes(data))
    with pytest.raises(IndexFormatError, match="header checksum mismatch.*wds-pad index"):
        load_index(path)


def test_refuses_digest_mismatch_unless_verify_is_off(tmp_path, index_bytes) -> None:
    data = bytearray(index_bytes)
    hlen = struct.unpack_from("<Q", index_bytes, 16)[0]
    sections = json.loads(index_bytes[24 : 24 + hlen])["sections"]
    data[-(-(24 + hlen) // 64) * 64 + sections["offset"]["offset"]] ^= 0x01  # a sample's offset: crc still fine
    path = _write(tmp_path, bytes(data))
    with pytest.raises(IndexFormatError, match="content digest mismatch"):
        load_index(path)
    assert len(load_index(path, verify=False)) == 7  # huge files skip the check by default


def test_refuses_missing_empty_and_directory(tmp_path) -> None:
    with pytest.raises(IndexFormatError, match="does not exist"):
        load_index(str(tmp_path / "nope.wdsidx"))
    with pytest.raises(IndexFormatError, match="file of 0 bytes"):
        load_index(_write(tmp_path, b""))
    with pytest.raises(IndexFormatError, match="is a directory"):
        load_index(str(tmp_path))


def test_an_index_opened_with_no_descriptor_left_says_to_raise_the_limit(tmp_path) -> None:
    """A real EMFILE: a child process lowers its soft limit and fills its descriptor table."""
    path = write_index(small_index(), str(tmp_path / "toy.wdsidx"))
    code = f"""
import os, resource
from wds_pad.errors import ReadError
from wds_pad.index.codec import load_index
resource.setrlimit(resource.RLIMIT_NOFILE, (32, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
held = []
try:
    while True:
        held.append(os.open(os.devnull, os.O_RDONLY))
except OSError:
    pass
try:
    load_index({path!r})
except ReadError as exc:
    print(exc)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stderr == "", out.stderr
    assert f"cannot open index {path!r}" in out.stdout and "EMFILE" in out.stdout
    assert "ulimit -n" in out.stdout


def test_an_index_this_account_may_not_read_says_who_can_fix_it(tmp_path, monkeypatch) -> None:
    path = write_index(small_index(), str(tmp_path / "toy.wdsidx"))

    def denied(*args, **kwargs):
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr(codec, "open", denied, raising=False)  # root reads anything: deny it here
    with pytest.raises(ReadError, match=r"permission denied.*chmod a\+r"):
        load_index(path)


def test_index_rejects_inconsistent_arrays() -> None:
    good = small_index()
    arrays = dict(good.arrays)
    arrays["offset"] = arrays["offset"][:-1]
    with pytest.raises(IndexFormatError, match="array 'offset' has 6 rows, expected 7"):
        Index(shards=good.shards, buckets=good.buckets, arrays=arrays, bucket_by={})


# -- atomic writes --------------------------------------------------------------------------
def test_failed_write_leaves_previous_file_and_no_temp(tmp_path, monkeypatch) -> None:
    path = str(tmp_path / "toy.wdsidx")
    write_index(small_index("first"), path)
    before = open(path, "rb").read()

    def boom(fd: int) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", boom)
    with pytest.raises(OSError, match="disk full"):
        write_index(small_index("second"), path)
    assert open(path, "rb").read() == before
    assert load_index(path).name == "first"
    assert os.listdir(tmp_path) == ["toy.wdsidx"]  # the temp file was removed


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text(max_size=6), max_size=12))
def test_pack_keys_round_trips_any_keys(keys):
    """Keys are packed in one vectorised pass (or one by one when a key holds a NUL)."""
    from wds_pad.index.rows import _pack_keys

    offsets, blob = _pack_keys(keys)
    assert offsets[0] == 0 and offsets[-1] == len(blob) and len(offsets) == len(keys) + 1
    assert [bytes(blob[offsets[i]:offsets[i + 1]]).decode("utf-8") for i in range(len(keys))] == keys


# -- what write_index refuses to overwrite ------------------------------------------------
def test_write_index_replaces_an_index_but_refuses_other_files_unless_forced(tmp_path) -> None:
    from wds_pad.errors import ConfigError

    path = tmp_path / "toy.wdsidx"
    write_index(small_index("first"), str(path))
    write_index(small_index("second"), str(path))  # an index is replaced: re-indexing, --update
    assert load_index(str(path)).name == "second"
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes")
    with pytest.raises(ConfigError, match=r"'.*notes\.txt' exists and is not a wds_pad index \(8 bytes.*--force"):
        write_index(small_index(), str(notes))
    assert notes.read_text() == "my notes"
    with pytest.raises(ConfigError, match="force must be True or False, got str 'false'"):
        write_index(small_index(), str(notes), force="false")  # a config file's "false" replaces nothing
    assert notes.read_text() == "my notes"
    write_index(small_index("forced"), str(notes), force=True)
    assert load_index(str(notes)).name == "forced"
    empty = tmp_path / "empty.wdsidx"  # e.g. from mktemp: nothing to lose
    empty.write_bytes(b"")
    write_index(small_index("was empty"), str(empty))
    assert load_index(str(empty)).name == "was empty"


def test_write_index_refuses_a_shard_it_indexes(tmp_path) -> None:
    from wds_pad.errors import ConfigError

    shard = tmp_path / "a.tar"
    shard.write_bytes(b"\0" * 10240)
    index = make_index([ShardInfo(str(shard), 10240, "mtime=1", 1)],
                       {k: np.zeros(1, np.int64) for k in ("shard", "offset", "length", "bucket", "exts")},
                       ["all"], ["k"], bucket_by={"kind": "none"}, exts=[])
    os.symlink(shard, tmp_path / "link.tar")
    os.link(shard, tmp_path / "hard.tar")
    for target in (str(shard), f"{tmp_path}/./a.tar", f"file://{shard}", str(tmp_path / "link.tar"),
                   str(tmp_path / "hard.tar")):
        for force in (False, True):
            with pytest.raises(ConfigError, match="input shard.*would destroy the shard"):
                write_index(index, target, force=force)
    assert shard.read_bytes() == b"\0" * 10240


def test_write_index_refuses_unwritable_places_before_writing(tmp_path) -> None:
    from wds_pad.errors import ConfigError

    (tmp_path / "afile").write_text("x")
    cases = [
        ("", "path is empty"),
        (str(tmp_path), "is a directory; give a file path, e.g. -o"),
        (f"{tmp_path}/new-dir/", "is a directory"),
        (str(tmp_path / "afile" / "i.wdsidx"), r"cannot be created: '.*afile' is a file, not a directory"),
        (str(tmp_path / "afile" / "deeper" / "i.wdsidx"), "is a file, not a directory"),
    ]
    if hasattr(os, "mkfifo"):
        os.mkfifo(tmp_path / "fifo")
        cases.append((str(tmp_path / "fifo"), "not a regular file"))
    for path, message in cases:
        for force in (False, True):
            with pytest.raises(ConfigError, match=message):
                write_index(small_index(), path, force=force)
    assert sorted(os.listdir(tmp_path)) == sorted(["afile"] + (["fifo"] if hasattr(os, "mkfifo") else []))
    write_index(small_index(), str(tmp_path / "made" / "for" / "it.wdsidx"))  # missing parents are created
    assert load_index(str(tmp_path / "made" / "for" / "it.wdsidx")).name == "toy"


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root may write anywhere")
def test_write_index_refuses_a_read_only_directory(tmp_path) -> None:
    from wds_pad.errors import ConfigError

    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        with pytest.raises(ConfigError, match="no permission to write in directory"):
            write_index(small_index(), str(locked / "sub" / "i.wdsidx"))
    finally:
        locked.chmod(0o700)


def test_write_index_remote_refusals() -> None:
    from wds_pad.errors import ConfigError

    fs = fsspec.filesystem("memory")
    fs.pipe("/refuse/notes.txt", b"my notes")
    fs.pipe("/refuse/dir/x.bin", b"x")
    with pytest.raises(ConfigError, match="'memory://refuse/notes.txt' exists and is not a wds_pad index"):
        write_index(small_index(), "memory://refuse/notes.txt")
    with pytest.raises(ConfigError, match="is a directory"):
        write_index(small_index(), "memory://refuse/dir")
    assert fs.cat("/refuse/notes.txt") == b"my notes"
    write_index(small_index("one"), "memory://refuse/i.wdsidx")
    write_index(small_index("two"), "memory://refuse/i.wdsidx")
    write_index(small_index("forced"), "memory://refuse/notes.txt", force=True)
    assert load_index("memory://refuse/notes.txt").name == "forced"


def test_build_index_checks_its_output_before_scanning(tmp_path, monkeypatch) -> None:
    import wds_pad.index.build as indexer_mod
    from wds_pad.cli.synth import make_image_shards
    from wds_pad.errors import ConfigError
    from wds_pad.index.build import build_index

    shards = make_image_shards(tmp_path / "shards", samples=8, shards=2, seed=1)
    before = [open(s, "rb").read() for s in shards]

    def no_scan(*args, **kw):
        raise AssertionError("scanned before the output was checked")

    monkeypatch.setattr(indexer_mod, "_scan_group", no_scan)
    (tmp_path / "notes.txt").write_text("mine")
    for output, message in [(shards[1], "input shards"), (str(tmp_path), "is a directory"),
                            (str(tmp_path / "notes.txt"), "not a wds_pad index"),
                            (os.path.join(shards[0], "i.wdsidx"), "is a file, not a directory")]:
        with pytest.raises(ConfigError, match=message):
            build_index(shards, output=output)
    with pytest.raises(ConfigError, match="input shards"):
        build_index(shards, output=shards[0], force=True)
    assert [open(s, "rb").read() for s in shards] == before
    monkeypatch.undo()
    out = build_index(shards, output=str(tmp_path / "notes.txt"), force=True)
    assert load_index(str(tmp_path / "notes.txt")).digest == out.digest
