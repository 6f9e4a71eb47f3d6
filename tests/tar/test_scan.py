"""Tests for the tar readers: wds_pad.tar.scan (header parsing, webdataset grouping, faults,
parse_sample; the rules live in tar.headers and tar.members) and the lean path of tar.lean /
tar.leanstream / tar.settle."""

from __future__ import annotations

import gzip
import io
import os
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest
import webdataset as wds
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from webdataset.tariterators import base_plus_ext

from wds_pad.errors import ConfigError, StaleShardError, TarFormatError
from wds_pad.tar import reader as tar_reader
from wds_pad.tar import lean as tar_lean
from wds_pad.tar import leanstream as tar_leanstream
from wds_pad.tar import members as tar_members
from wds_pad.tar.columns import ScanRows
from wds_pad.tar.lean import scan_rows
from wds_pad.tar.scan import Member, ScannedSample, parse_sample, scan_tar, split_key

WDS_META = ("__key__", "__url__", "__local_path__")


from data_helpers import NonSeekable  # noqa: E402

# ---------------------------------------------------------------- helpers


class CountingFile(io.RawIOBase):
    """A seekable in-memory file without fileno() that counts the bytes read."""

    def __init__(self, data: bytes) -> None:
        self._f, self.read_bytes = io.BytesIO(data), 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, off: int, whence: int = 0) -> int:
        return self._f.seek(off, whence)

    def tell(self) -> int:
        return self._f.tell()

    def readinto(self, b) -> int:  # type: ignore[no-untyped-def]
        chunk = self._f.read(len(b))
        b[: len(chunk)] = chunk
        self.read_bytes += len(chunk)
        return len(chunk)


def scan_path(path: Path, *, seekable: bool = True, **kw) -> list[ScannedSample]:  # type: ignore[no-untyped-def]
    """scan_tar's samples; also checks that the indexer's scan_rows finds the same (or
    raises the same error) in the same mode."""

    def run(fn):  # type: ignore[no-untyped-def]
        if seekable:
            with open(path, "rb") as f:
                return fn(f, str(path), seekable=True, **kw)
        return fn(NonSeekable(path.read_bytes(), step=777), str(path), **kw)

    try:
        samples = run(lambda *a, **k: list(scan_tar(*a, **k)))
    except Exception as exc:
        with pytest.raises(type(exc)) as info:
            run(scan_rows)
        assert str(info.value) == str(exc)
        raise
    assert_same_rows(run(scan_rows), samples)
    return samples


def assert_same_rows(rows: ScanRows, samples: list[ScannedSample]) -> None:
    assert rows.keys == [s.key for s in samples]
    assert rows.offset.tolist() == [s.offset for s in samples]
    assert rows.length.tolist() == [s.length for s in samples]
    assert [set(rows.sample_exts(i)) for i in range(len(rows))] == [{m.ext for m in s.members} for s in samples]
    assert [rows.sample_data(i) for i in range(len(rows))] == [s.data for s in samples]


def wds_samples(path: Path) -> list[dict]:
    return list(wds.WebDataset(str(path), shardshuffle=False, empty_check=False))


def write_tar(path: Path, entries: list[tuple[str, bytes | None]], fmt: int = tarfile.GNU_FORMAT) -> Path:
    """Write (name, payload) pairs; payload None makes a directory, b'->x' a symlink to x."""
    with tarfile.open(path, "w", format=fmt) as tf:
        for name, payload in entries:
            ti = tarfile.TarInfo(name)
            ti.mtime = 1_700_000_000
            if payload is None:
                ti.type = tarfile.DIRTYPE
                tf.addfile(ti)
            elif payload.startswith(b"->"):
                ti.type, ti.linkname = tarfile.SYMTYPE, payload[2:].decode()
                tf.addfile(ti)
            else:
                ti.size = len(payload)
                tf.addfile(ti, io.BytesIO(payload))
    return path


def check_shard(path: Path) -> list[ScannedSample]:
    """Scan ``path`` in both modes and check it against tarfile and webdataset."""
    exts = {m.ext for s in scan_path(path) for m in s.members}
    seek = scan_path(path, want=exts)
    assert scan_path(path, seekable=False, want=exts) == seek  # stream mode: identical records

    # tarfile: every member of a kept sample, with the same name, offsets and size.
    kept, expected = {s.key for s in seek}, []
    with tarfile.open(path, "r:") as tf:
        for ti in tf:
            prefix, _ = base_plus_ext(ti.name)
            if ti.isreg() and prefix in kept and not tar_members.is_meta(ti.name):
                expected.append((ti.name, ti.offset, ti.offset_data, ti.size))
    got = [(m.name, m.header_offset, m.data_offset, m.size) for s in seek for m in s.members]
    assert got == expected

    # webdataset: same keys in the same order, same suffixes, same bytes.
    ref = wds_samples(path)
    assert [s.key for s in seek] == [d["__key__"] for d in ref]
    blob = path.read_bytes()
    for s, d in zip(seek, ref):
        payloads = {k: v for k, v in d.items() if k not in WDS_META}
        assert parse_sample(blob[s.offset : s.offset + s.length], str(path), s.offset, s.key) == payloads
        assert s.data == payloads
        assert [m.ext for m in s.members] == list(payloads)
        last = s.members[-1]
        assert s.offset == s.members[0].header_offset
        assert s.offset + s.length == last.data_offset + (last.size + 511) // 512 * 512
    return seek


def patch_header(blob: bytearray, off: int, field: slice, value: bytes, *, signed: bool = False) -> None:
    """Overwrite a header field at ``off`` and recompute its checksum."""
    blob[off + field.start : off + field.stop] = value.ljust(field.stop - field.start, b"\0")
    blob[off + 148 : off + 156] = b" " * 8
    hdr = bytes(blob[off : off + 512])
    chk = sum(b - 256 if signed and b >= 128 else b for b in hdr)
    blob[off + 148 : off + 156] = b"%06o\0 " % chk


# ---------------------------------------------------------------- real writers


needs_gnu_tar = pytest.mark.skipif(shutil.which("tar") is None, reason="GNU tar not installed")


def make_tree(root: Path) -> list[str]:
    long_dir = "d" * 70 + "/" + "e" * 40
    files = {
        "s1.jpg": b"jpeg-1" * 50,
        "s1.json": b'{"a": 1}',
        "s1.seg.png": b"png",
        f"{long_dir}/long{'x' * 30}.jpg": b"L" * 1234,
        f"{long_dir}/long{'x' * 30}.cls": b"7",
        "a.b/c.jpg": b"dotdir",
        "a.b/c.txt": b"",
        "noext": b"skipped",
        "__meta__": b"skipped too",
        "s2.JPG": b"upper",
    }
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    (root / "emptydir").mkdir()
    os.symlink("s1.jpg", root / "s3.jpg")
    return sorted(files) + ["emptydir", "s3.jpg"]


@needs_gnu_tar
@pytest.mark.parametrize("fmt", ["gnu", "pax", "ustar"])
def test_gnu_tar_formats_match_tarfile_and_webdataset(tmp_path: Path, fmt: str) -> None:
    src = tmp_path / "src"
    src.mkdir()
    names = make_tree(src)
    if fmt == "pax":  # pax takes non-ASCII and > 155-character names; ustar and gnu differ
        (src / "ünï-çødé.jpg").write_bytes(b"utf8")
        (src / ("p" * 120 + ".jpg")).write_bytes(b"long")
        names += ["ünï-çødé.jpg", "p" * 120 + ".jpg"]
    shard = tmp_path / f"{fmt}.tar"
    subprocess.run(["tar", f"--format={fmt}", "-cf", str(shard), "-C", str(src), *names], check=True)
    samples = check_shard(shard)
    keys = [s.key for s in samples]
    assert "a.b/c" in keys and "s2" in keys and "s3" not in keys  # dot dir kept, symlink skipped
    s1 = next(s for s in samples if s.key == "s1")
    assert sorted(m.ext for m in s1.members) == ["jpg", "json", "seg.png"]
    assert next(s for s in samples if s.key == "s2").members[0].ext == "jpg"  # lowercased
    if fmt == "pax":
        assert "ünï-çødé" in keys and "p" * 120 in keys


@pytest.mark.parametrize("fmt", [tarfile.GNU_FORMAT, tarfile.PAX_FORMAT, tarfile.USTAR_FORMAT])
def test_python_tarfile_formats(tmp_path: Path, fmt: int) -> None:
    long = "x" * 80 if fmt == tarfile.USTAR_FORMAT else "y" * 150
    entries: list[tuple[str, bytes | None]] = [
        ("dir", None),
        ("k1.jpg", b"a" * 513),
        ("dir", None),  # a directory between two members of one sample
        ("k1.json", b"{}"),
        ("k1.link", b"->k1.jpg"),  # a symlink inside the sample: skipped, still in range
        ("k1.txt", b"t"),
        (f"deep/{long}/k2.jpg", b"b" * 512),
        (f"deep/{long}/k2.txt", b"c" * 1000),
        ("noext", b"zzz"),
        ("__dir__/k3.jpg", b"meta dir, skipped"),
        ("k4.tar.gz", b"multi-dot"),
    ]
    if fmt == tarfile.PAX_FORMAT:
        entries.append(("naïve-ü/k5.jpg", b"unicode"))
    samples = check_shard(write_tar(tmp_path / "t.tar", entries, fmt))
    assert [s.key for s in samples][:3] == ["k1", f"deep/{long}/k2", "k4"]
    assert [m.ext for m in samples[0].members] == ["jpg", "json", "txt"]
    assert samples[2].members[0].ext == "tar.gz"


def test_webdataset_writers(tmp_path: Path) -> None:
    with wds.TarWriter(str(tmp_path / "w.tar"), encoder=False) as w:
        for i in range(20):
            w.write({"__key__": f"dir.v1/s{i:03d}", "jpg": os.urandom(i * 37), "json": b"{}", "cls": b"%d" % i})
    samples = check_shard(tmp_path / "w.tar")
    assert [s.key for s in samples] == [f"dir.v1/s{i:03d}" for i in range(20)]

    pattern = str(tmp_path / "shard-%02d.tar")
    with wds.ShardWriter(pattern, maxcount=7, encoder=False) as sw:
        for i in range(20):
            sw.write({"__key__": f"k{i:03d}", "txt": b"x" * i})
    shards = sorted(tmp_path.glob("shard-*.tar"))
    assert len(shards) == 3
    assert sum(len(check_shard(p)) for p in shards) == 20


def test_bad_and_reserved_suffixes_like_webdataset(tmp_path: Path) -> None:
    shard = write_tar(tmp_path / "b.tar", [("a.jpg", b"1"), ("b.jpg", b"2"), ("b.__bad__", b"x"), ("c.jpg", b"3")])
    assert [s.key for s in check_shard(shard)] == ["a", "c"]  # a non-empty __bad__ drops the sample
    dup = write_tar(tmp_path / "d.tar", [("a.jpg", b"1"), ("a.JPG", b"2")])
    with pytest.raises(TarFormatError, match=r"duplicate suffix 'jpg'.*sample key 'a'") as ei:
        scan_path(dup)
    assert str(dup) in str(ei.value) and "byte offset 1024" in str(ei.value)
    with pytest.raises(ValueError):  # webdataset rejects it too
        wds_samples(dup)
    with pytest.raises(TarFormatError, match="duplicate suffix '__key__'"):
        scan_path(write_tar(tmp_path / "k.tar", [("a.__key__", b"1")]))


def test_split_key_mirrors_base_plus_ext() -> None:
    names = ["a.jpg", "a.b/c.seg.png", "dir/.hidden.jpg", "noext", "dir/noext", ".x", "a/b/c.", "x.y/z", "a.b.c",
             "a\nb.jpg", "dir/a.b\n", "__k__.jpg"]
    for name in names:
        key, ext = base_plus_ext(name)
        assert split_key(name) == (None if key is None else (key, ext)), name
    assert split_key("a.b/c.JPG") == ("a.b/c", "JPG")


# ---------------------------------------------------------------- header kinds


def test_base256_size_signed_checksum_and_pax_size(tmp_path: Path) -> None:
    shard = write_tar(tmp_path / "t.tar", [("k.jpg", b"j" * 700), ("k.txt", b"t" * 3), ("ü.json", b"{}")])
    blob = bytearray(shard.read_bytes())
    patch_header(blob, 0, slice(124, 136), b"\x80" + (700).to_bytes(11, "big"))  # base-256 size
    (tmp_path / "b256.tar").write_bytes(blob)
    assert check_shard(tmp_path / "b256.tar")[0].members[0].size == 700

    # "ü.json" (header at 2560): a GNU header with a non-ASCII name, checksum as signed chars
    assert blob[2560 : 2560 + 2] == "ü".encode()
    patch_header(blob, 2560, slice(0, 100), "ü.json".encode(), signed=True)
    assert blob[2560 + 148 : 2560 + 156] != bytes(blob)[2560 + 148 : 2560 + 156] or True
    (tmp_path / "signed.tar").write_bytes(blob)
    assert [s.key for s in check_shard(tmp_path / "signed.tar")] == ["k", "ü"]

    # A pax 'size' overrides the header's size field (tarfile does the same).
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        ti = tarfile.TarInfo("p.bin")
        ti.size, ti.pax_headers = 600, {"size": "600"}
        tf.addfile(ti, io.BytesIO(b"p" * 600))
        ti = tarfile.TarInfo("q.bin")
        ti.size = 5
        tf.addfile(ti, io.BytesIO(b"q" * 5))
    pax = bytearray(buf.getvalue())
    patch_header(pax, 1024, slice(124, 136), b"%011o" % 0)  # header says 0, pax says 600
    (tmp_path / "pax.tar").write_bytes(pax)
    samples = check_shard(tmp_path / "pax.tar")
    assert [(s.key, s.members[0].size, s.members[0].header_offset) for s in samples] == [("p", 600, 0), ("q", 5, 2560)]


def test_global_pax_header_and_sparse(tmp_path: Path) -> None:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT, pax_headers={"comment": "v1"}) as tf:
        for name in ("g1.jpg", "g1.txt"):
            ti = tarfile.TarInfo(name)
            ti.size = 4
            tf.addfile(ti, io.BytesIO(b"gggg"))
    (tmp_path / "g.tar").write_bytes(buf.getvalue())
    (sample,) = check_shard(tmp_path / "g.tar")
    assert sample.offset == 1024  # the leading global header is not part of the sample

    bad = bytearray(buf.getvalue())
    patch_header(bad, 1024, slice(156, 157), b"S")  # an old-GNU sparse member
    (tmp_path / "s.tar").write_bytes(bad)
    with pytest.raises(TarFormatError, match="sparse members are not supported"):
        scan_path(tmp_path / "s.tar")


# ---------------------------------------------------------------- faults


def sample_shard(tmp_path: Path, n: int = 4) -> Path:
    return write_tar(tmp_path / "ok.tar", [(f"s{i}.{e}", bytes([i]) * (300 + i)) for i in range(n) for e in ("a", "b")])


@pytest.mark.parametrize("seekable", [True, False])
def test_not_a_tar_and_compressed(tmp_path: Path, seekable: bool) -> None:
    (tmp_path / "text.tar").write_bytes(b"hello, this is not a tar archive\n" * 40)
    with pytest.raises(TarFormatError, match=r"text\.tar: not a tar archive .*byte offset 0.*on_error='skip'"):
        scan_path(tmp_path / "text.tar", seekable=seekable)
    (tmp_path / "z.tar.gz").write_bytes(gzip.compress(sample_shard(tmp_path).read_bytes()))
    with pytest.raises(TarFormatError, match="gzip-compressed"):
        scan_path(tmp_path / "z.tar.gz", seekable=seekable)


@pytest.mark.parametrize("seekable", [True, False])
def test_bad_checksum(tmp_path: Path, seekable: bool) -> None:
    blob = bytearray(sample_shard(tmp_path).read_bytes())
    second = 512 + 512  # header of s0.b
    blob[second + 10] ^= 0x01
    (tmp_path / "bad.tar").write_bytes(blob)
    with pytest.raises(TarFormatError, match=r"bad\.tar: invalid tar header \(bad header checksum\) at byte offset 1024"):
        scan_path(tmp_path / "bad.tar", seekable=seekable)
    with pytest.raises(tarfile.HeaderError):
        tarfile.TarInfo.frombuf(bytes(blob[second : second + 512]), "utf-8", "surrogateescape")


@pytest.mark.parametrize("seekable", [True, False])
def test_truncated(tmp_path: Path, seekable: bool) -> None:
    blob = sample_shard(tmp_path).read_bytes()
    (tmp_path / "hdr.tar").write_bytes(blob[: 2048 + 100])  # inside the header of s1.a
    with pytest.raises(TarFormatError, match=r"truncated tar header \(100 of 512 bytes\) at byte offset 2048"):
        scan_path(tmp_path / "hdr.tar", seekable=seekable)
    (tmp_path / "pay.tar").write_bytes(blob[: 2048 + 512 + 50])  # inside the payload of s1.a
    with pytest.raises(TarFormatError, match=r"truncated inside the payload.*s1\.a"):
        scan_path(tmp_path / "pay.tar", seekable=seekable)
    with pytest.raises(TarFormatError, match=r"truncated inside the payload.*s1\.a"):
        scan_path(tmp_path / "pay.tar", seekable=seekable, want=("a",))
    # One read returns the whole stream: EOF shows only when the next header is read
    # (the same message as seek mode, at the offset where the file ends).
    with pytest.raises(TarFormatError, match=r"truncated inside the payload \(301 bytes at byte offset 2560, padded to 3072\): the file ends at byte offset 2610, member 's1\.a'"):
        list(scan_tar(NonSeekable((tmp_path / "pay.tar").read_bytes()), "u"))


@pytest.mark.parametrize("seekable", [True, False])
def test_early_end_and_empty_archives(tmp_path: Path, seekable: bool) -> None:
    full = sample_shard(tmp_path)
    blob = full.read_bytes()
    (tmp_path / "early.tar").write_bytes(blob[: 8 * 1024])  # no end-of-archive blocks: still valid
    assert scan_path(tmp_path / "early.tar", seekable=seekable) == scan_path(full, seekable=seekable)
    assert len(wds_samples(tmp_path / "early.tar")) == 4

    (tmp_path / "zeros.tar").write_bytes(b"\0" * 10240)  # only end blocks: zero samples
    assert scan_path(tmp_path / "zeros.tar", seekable=seekable) == []
    (tmp_path / "empty.tar").write_bytes(b"")  # tarfile (hence webdataset) rejects a 0-byte file
    with pytest.raises(TarFormatError, match="empty file"):
        scan_path(tmp_path / "empty.tar", seekable=seekable)
    with pytest.raises(tarfile.ReadError):
        tarfile.open(fileobj=io.BytesIO(b""), mode="r|*")


def test_on_error_skip_yields_completed_samples(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    blob = bytearray(sample_shard(tmp_path).read_bytes())
    blob[2048 + 3 * 1024 + 20] ^= 0xFF  # header of s2.b: s0, s1 complete, s2 in progress
    (tmp_path / "bad.tar").write_bytes(blob)

    def run() -> tuple[list[ScannedSample], object]:
        with open(tmp_path / "bad.tar", "rb") as f:
            got: list[ScannedSample] = []
            gen = scan_tar(f, "u://bad.tar", on_error="skip")

            def collect():  # type: ignore[no-untyped-def]
                err = yield from gen
                return err

            it = collect()
            while True:
                try:
                    got.append(next(it))
                except StopIteration as stop:
                    return got, stop.value

    got, err = run()
    assert [s.key for s in got] == ["s0", "s1"]
    assert isinstance(err, TarFormatError) and "u://bad.tar" in str(err)
    assert "skipping the rest of shard" in caplog.text
    with open(sample_shard(tmp_path), "rb") as f:
        gen = scan_tar(f, "ok", on_error="skip")
        assert len(list(gen)) == 4
    with pytest.raises(ConfigError):
        scan_tar(io.BytesIO(), "u", on_error="ignore")
    with pytest.raises(ConfigError):
        scan_tar(io.BytesIO(), "u", head_bytes=-1)


# ---------------------------------------------------------------- reading


def test_seek_mode_reads_only_wanted_heads(tmp_path: Path) -> None:
    with wds.TarWriter(str(tmp_path / "big.tar"), encoder=False) as w:
        for i in range(10):
            w.write({"__key__": f"s{i}", "jpg": os.urandom(100_000), "json": b'{"w": %d}' % i})
    data = (tmp_path / "big.tar").read_bytes()
    f = CountingFile(data)
    got = list(scan_tar(f, "mem", want=("JSON", "jpg"), head_bytes=16))
    assert f.read_bytes < len(data) // 10
    assert [s.data["json"] for s in got] == [b'{"w": %d}' % i for i in range(10)]
    assert all(len(s.data["jpg"]) == 16 for s in got)
    ref = wds_samples(tmp_path / "big.tar")
    assert [s.data["jpg"] for s in got] == [d["jpg"][:16] for d in ref]
    stream = list(scan_tar(NonSeekable(data, 5000), "mem", want="json"))
    assert [s.data for s in stream] == [{"json": s.data["json"]} for s in got]


def test_stream_mode_chunk_boundaries(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_tar(tmp_path / "c.tar", [(f"k{i}.{e}", os.urandom(i * 97 % 1500)) for i in range(30) for e in "xyz"])
    ref = scan_path(path, want=("x", "y", "z"))
    monkeypatch.setattr(tar_reader, "_CHUNK", 700)  # headers and payloads straddle reads
    for step in (1, 333, 4096):
        got = list(scan_tar(NonSeekable(path.read_bytes(), step), "c", want=("x", "y", "z")))
        assert got == ref


def test_parse_sample_detects_changed_shards(tmp_path: Path) -> None:
    path = sample_shard(tmp_path)
    blob = path.read_bytes()
    s = scan_path(path)[1]
    rng = blob[s.offset : s.offset + s.length]
    assert parse_sample(rng, "u", s.offset, "s1") == {"a": b"\1" * 301, "b": b"\1" * 301}
    assert parse_sample(blob[0:1024], "u", 0, "s0") == {"a": b"\0" * 300}  # a prefix of s0 parses
    with pytest.raises(StaleShardError, match=r"u: the 1024 bytes at offset 0 are not sample 's1'"):
        parse_sample(blob[0:1024], "u", 0, "s1")
    with pytest.raises(StaleShardError, match="not sample 's0'"):
        parse_sample(rng, "u", s.offset, "s0")  # the key differs
    flipped = bytearray(rng)
    flipped[5] ^= 1
    with pytest.raises(StaleShardError, match=r"offset 2048 .*re-index"):
        parse_sample(bytes(flipped), "u", s.offset, "s1")
    with pytest.raises(StaleShardError):
        parse_sample(rng[:-512], "u", s.offset, "s1")  # payload runs past the range
    with pytest.raises(StaleShardError):
        parse_sample(rng + blob[s.offset + s.length : s.offset + s.length + 1024], "u", s.offset, "s1")  # 2 keys
    with pytest.raises(StaleShardError):
        parse_sample(b"\0" * 1024, "u", 0)
    with pytest.raises(StaleShardError):
        parse_sample(b"", "u", 0)


# ---------------------------------------------------------------- property


exts_st = st.sets(st.sampled_from(["jpg", "json", "txt", "cls", "seg.png", "mp4", "npy"]), min_size=1, max_size=4)
sample_st = st.tuples(
    st.sampled_from(["", "a.b/", "dir/sub/", "x" * 95 + "/"]),  # dots in dirs, long names
    exts_st,
    st.lists(st.integers(0, 2000), min_size=4, max_size=4),
)


@settings(max_examples=40, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(samples=st.lists(sample_st, min_size=0, max_size=8), head=st.none() | st.integers(0, 600), seed=st.integers(0, 9))
def test_property_writer_roundtrip(tmp_path: Path, samples: list, head: int | None, seed: int) -> None:
    path = tmp_path / f"p{seed}.tar"
    written = []
    with wds.TarWriter(str(path), encoder=False) as w:
        for i, (prefix, exts, sizes) in enumerate(samples):
            key = f"{prefix}k{i:03d}"
            payloads = {e: bytes([(i + seed) % 256]) * n for e, n in zip(sorted(exts), sizes)}
            w.write({"__key__": key, **payloads})
            written.append((key, payloads))
    blob = path.read_bytes()
    for seekable in (True, False):
        got = scan_path(path, seekable=seekable, want=("json", "seg.png"), head_bytes=head)
        assert [(s.key, {m.ext: m.size for m in s.members}) for s in got] == [
            (k, {e: len(v) for e, v in p.items()}) for k, p in written
        ]
        for s, (key, payloads) in zip(got, written):
            assert parse_sample(blob[s.offset : s.offset + s.length], str(path), s.offset, key) == payloads
            assert s.data == {e: v[:head] if head is not None else v for e, v in payloads.items() if e in ("json", "seg.png")}
            assert [blob[m.data_offset : m.data_offset + m.size] for m in s.members] == [payloads[m.ext] for m in s.members]


def test_member_records() -> None:
    m = tar_members._member("a.jpg", "jpg", 0, 512, 3)
    assert m == Member("a.jpg", "jpg", 0, 512, 3) and hash(m) == hash(Member("a.jpg", "jpg", 0, 512, 3))
    with pytest.raises(AttributeError):
        m.size = 4  # type: ignore[misc]
    with pytest.raises(ConfigError):
        ScannedSample("k", 100, 512, (m,))
    with pytest.raises(ConfigError):
        ScannedSample("k", 0, 1024, ())


def test_fsspec_files_local_and_memory(tmp_path: Path) -> None:
    fsspec = pytest.importorskip("fsspec")
    path = sample_shard(tmp_path, n=6)
    ref = scan_path(path, want=("a",))
    with fsspec.open(str(path), "rb") as f:  # local: the os.pread fast path
        assert list(scan_tar(f, str(path), want=("a",))) == ref
    with fsspec.open("memory://shards/ok.tar", "wb") as f:
        f.write(path.read_bytes())
    with fsspec.open("memory://shards/ok.tar", "rb") as f:  # no fileno: seek + read
        assert list(scan_tar(f, "memory://shards/ok.tar", want=("a",))) == ref


def test_parse_sample_at_reads_large_payloads_without_a_range_buffer(tmp_path):
    """parse_sample_at (local fd, one pread per large payload) equals parse_sample."""
    import os

    import webdataset as wds

    from wds_pad.errors import StaleShardError
    from wds_pad.tar.scan import parse_sample_at

    path = tmp_path / "big.tar"
    rng = __import__("random").Random(3)
    with wds.TarWriter(str(path)) as w:
        for i, size in enumerate([0, 100, 4095, 4096, 300_000, 700_001]):
            w.write({"__key__": f"s{i:03d}", "bin": rng.randbytes(size), "json": b'{"i": %d}' % i})
    with open(path, "rb") as f:
        samples = list(scan_tar(f, str(path)))
    fd = os.open(path, os.O_RDONLY)
    try:
        for s in samples:
            with open(path, "rb") as f:
                f.seek(s.offset)
                data = f.read(s.length)
            assert parse_sample_at(fd, str(path), s.offset, s.length, s.key) == parse_sample(data, str(path), s.offset, s.key)
        s = samples[-1]
        with pytest.raises(StaleShardError, match="not sample"):
            parse_sample_at(fd, str(path), s.offset, s.length, "other-key")
        with pytest.raises(StaleShardError):
            parse_sample_at(fd, str(path), s.offset + 512, s.length, s.key)
    finally:
        os.close(fd)


def test_lean_scan_hands_over_to_the_full_rules_mid_shard(tmp_path):
    """scan_rows reads plain members in its lean loop; a long pax name, a non-ASCII name,
    a directory, metadata and a __bad__ sample mid-shard hand the shard to the general
    parser, and the rows equal scan_tar's (both modes) and webdataset's keys."""
    path = tmp_path / "mixed.tar"
    names = [f"s{i:03d}" for i in range(4)] + ["d/" + "x" * 120, "s005", "sé06", "s007", "s008", "s009"]
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tf:
        for i, key in enumerate(names):
            if i == 7:
                info = tarfile.TarInfo("adir")
                info.type = tarfile.DIRTYPE
                tf.addfile(info)
                meta = tarfile.TarInfo("__meta__")
                meta.size = 3
                tf.addfile(meta, io.BytesIO(b"abc"))
            exts = ["bin", "json"] + (["__bad__"] if i == 8 else [])
            for ext in exts:
                payload = (b"%d-%s" % (i, ext.encode())) * (i * 37 + 1)
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(payload)
                tf.addfile(info, io.BytesIO(payload))
    for seekable in (True, False):
        got = scan_path(path, seekable=seekable, want=("json",))  # compares scan_rows too
        assert [s.key for s in got] == [n for i, n in enumerate(names) if i != 8]  # __bad__ dropped
    wds_keys = [s["__key__"] for s in wds.WebDataset(str(path), shardshuffle=False)]
    assert [s.key for s in got] == wds_keys


def _entries_tar(entries: list[tuple[str, str, int]], fmt: int) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=fmt) as tf:
        for kind, name, size in entries:
            info = tarfile.TarInfo(name)
            info.mtime = 1_700_000_000
            if kind == "dir":
                info.type = tarfile.DIRTYPE
                tf.addfile(info)
            elif kind == "link":
                info.type, info.linkname = tarfile.SYMTYPE, "elsewhere"
                tf.addfile(info)
            else:
                info.size = size
                tf.addfile(info, io.BytesIO(bytes([len(name) % 251]) * size))
    return out.getvalue()


def _mutate(blob: bytes, how: str, where: int, value: int) -> bytes:
    """Damage one header of ``blob`` (fixing its checksum unless how == 'flip'), or cut it."""
    data = bytearray(blob)
    headers = [o for o in range(0, len(data) - 511, 512) if data[o + 257 : o + 262] == b"ustar"]
    if how == "cut":
        return bytes(data[: where % (len(data) + 1)])
    if not headers:
        return blob
    h = headers[where % len(headers)]
    field = {"flip": h + value % 512, "name": h + value % 100, "size": h + 124 + value % 12,
             "type": h + 156, "chk": h + 148 + value % 8}[how]
    data[field] = (data[field] + 1 + value % 200) % 256 if how != "type" else b"0125xLK"[value % 7]
    if how not in ("flip", "chk"):
        chk = sum(data[h : h + 148]) + 256 + sum(data[h + 156 : h + 512])
        data[h + 148 : h + 156] = b"%06o\0 " % chk
    return bytes(data)


plain_st = st.tuples(  # what the lean loop reads itself (and __bad__ / extension-less names it must refuse)
    st.just("file"),
    st.sampled_from(["a", "b", "c", "d/e", "f.g/h"]),
    st.sampled_from(["jpg", "json", "JSON", "seg.png", "txt", "json", "__bad__", "", "__key__"]),
    st.integers(0, 1500),
)
odd_st = st.tuples(  # what only the general parser reads
    st.sampled_from(["file", "file", "dir", "link"]),
    st.sampled_from(["x" * 110, "__meta__", "é", "a"]),
    st.sampled_from(["jpg", "json"]),
    st.integers(0, 700),
)
entries_st = st.tuples(st.lists(plain_st, max_size=14), st.lists(st.tuples(st.integers(0, 14), odd_st), max_size=2)).map(
    lambda t: [e for i, e in enumerate(t[0]) for e in ([o for j, o in t[1] if j == i] + [e])])


@settings(max_examples=150, suppress_health_check=[HealthCheck.function_scoped_fixture], deadline=None)
@given(entries=entries_st, fmt=st.sampled_from([tarfile.GNU_FORMAT, tarfile.PAX_FORMAT]),
       how=st.sampled_from(["none", "none", "none", "flip", "name", "size", "type", "chk", "cut"]),
       where=st.integers(0, 10**6), value=st.integers(0, 10**6), batch=st.sampled_from([1, 2, 3, 4096]),
       chunk=st.sampled_from([512, 1000, 4096, 1 << 20]), step=st.sampled_from([7, 777, 1 << 20]),
       head=st.none() | st.integers(0, 40), skip=st.booleans())
def test_property_scan_rows_equals_scan_tar(tmp_path, monkeypatch, entries, fmt, how, where, value, batch,
                                             chunk, step, head, skip):
    """On valid, damaged and truncated archives, with any batch and chunk size, the lean
    columnar scan gives scan_tar's samples, or raises its exact error, in both modes."""

    monkeypatch.setattr(tar_lean, "_BATCH", batch)
    monkeypatch.setattr(tar_leanstream, "_CHUNK", chunk)
    names = [(kind, f"{base}.{ext}" if ext or kind != "file" else base, size) for kind, base, ext, size in entries]
    blob = _entries_tar(names, fmt)
    if how != "none":
        blob = _mutate(blob, how, where, value)
    path = tmp_path / "t.tar"
    path.write_bytes(blob)
    kw = {"want": ("json", "seg.png"), "head_bytes": head, "on_error": "skip" if skip else "raise"}
    for seekable in (True, False):
        def run(fn):  # noqa: ANN001, ANN202
            if seekable:
                with open(path, "rb") as f:
                    return fn(f, str(path), seekable=True, **kw)
            return fn(NonSeekable(blob, step=step), str(path), **kw)

        def tar_samples(*a, **k):  # noqa: ANN002, ANN003, ANN202
            gen = scan_tar(*a, **k)
            out = []
            while True:
                try:
                    out.append(next(gen))
                except StopIteration as stop:
                    return out, stop.value

        try:
            samples, fault = run(tar_samples)
        except Exception as exc:  # noqa: BLE001
            with pytest.raises(type(exc)) as info:
                run(scan_rows)
            assert str(info.value) == str(exc)
            continue
        rows = run(scan_rows)
        assert_same_rows(rows, samples)
        assert str(rows.fault) == str(fault)



class _Unseekable(io.RawIOBase):
    def __init__(self, f):
        self.f = f

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def readinto(self, b) -> int:
        return self.f.readinto(b)


def _raw_header(name: bytes, size: int, kind: bytes = b"0", size_field: bytes | None = None,
                fix_checksum: bool = True) -> bytes:
    h = bytearray(512)
    h[: len(name)] = name
    h[100:108], h[108:116], h[116:124] = b"0000644\0", b"0000000\0", b"0000000\0"
    h[124:136] = size_field if size_field is not None else b"%011o\0" % size
    h[136:148] = b"%011o\0" % 1_700_000_000
    h[156:157] = kind
    h[257:265] = b"ustar\x0000"
    h[148:156] = b" " * 8
    if fix_checksum:
        h[148:156] = b"%06o\0 " % sum(h)
    else:
        h[148:156] = b"%06o\0 " % (sum(h) + 1)
    return bytes(h)


def _member_bytes(name: bytes, payload: bytes, **kw) -> bytes:  # type: ignore[no-untyped-def]
    pad = b"\0" * (-len(payload) % 512)
    return _raw_header(name, len(payload), **kw) + payload + pad


@pytest.mark.parametrize("odd", [
    [(b"s2.jpg", b"x" * 700, {"fix_checksum": False})],  # a checksum the lean checks must catch
    [(b"s2.jpg", b"x" * 70, {}), (b"s2.jpg", b"y", {})],  # a repeated suffix
    [(b"s2.JPG", b"x" * 7, {}), (b"s2.jpg", b"y", {})],  # repeated once lowercased
    [(b".json", b"{}", {})], [(b"d/.json", b"{}", {})], [(b"s2.", b"z", {})], [(b"s2", b"z", {})],
    [(b"s2.__bad__", b"bad", {})], [(b"s2.__key__", b"k", {})], [(b"__s2__", b"m", {})],
    [(b"d/__s2.jpg", b"m", {})], [(b"a\n.b/s2.jpg", b"n", {})], [("s\u00e92.jpg".encode(), b"u", {})],
    [(b"s2.jpg", b"c", {"kind": b"7"})], [(b"s2.jpg", b"c", {"kind": b"2"})], [(b"s2/", b"", {"kind": b"5"})],
    # 12 digits, no terminator; read as 11 digits the payload's second block would be a header
    [(b"s2.jpg", b"c" * 512 + _raw_header(b"s2.json", 0), {"size_field": b"000000002000"})],
    [(b"s2.jpg", b"c" * 512 + _raw_header(b"s2.json", 0), {})],  # a payload holding a header-like block
    [(b"s2.jpg", _raw_header(b"s2.json", 0) * 3, {})],
    [(b"s2.jpg", b"c" * 8, {"size_field": b"10\0\0\0\0\0\0\0\0\0\0"})],
    [(b"s2.jpg", b"c" * 8, {"size_field": b"\x80" + (8).to_bytes(11, "big")})],  # base-256
    [(b"s2." + b"e" * 17, b"long extension", {})], [(b"s2.json", b"{}", {}), (b"s2.Json", b"[]", {})],
])
@pytest.mark.parametrize("seekable", [True, False])
def test_lean_scan_leaves_every_odd_header_to_the_general_parser(tmp_path, monkeypatch, odd, seekable):
    """One odd member amid plain ones: scan_rows gives scan_tar's rows or its exact error."""

    monkeypatch.setattr(tar_lean, "_BATCH", 2)
    monkeypatch.setattr(tar_leanstream, "_CHUNK", 1024)
    blob = b"".join(_member_bytes(b"s%d.%s" % (i, e), b"%d" % i * 300) for i in (0, 1) for e in (b"jpg", b"json"))
    blob += b"".join(_member_bytes(name, payload, **kw) for name, payload, kw in odd)
    blob += b"".join(_member_bytes(b"s%d.%s" % (i, e), b"%d" % i * 30) for i in (3, 4, 5) for e in (b"jpg", b"json"))
    blob += b"\0" * 1024
    path = tmp_path / "odd.tar"
    path.write_bytes(blob)
    try:
        got = scan_path(path, seekable=seekable, want=("json",))  # asserts scan_rows == scan_tar
    except TarFormatError:
        return
    assert {"s0", "s1", "s3", "s4", "s5"} <= {s.key for s in got}


@settings(max_examples=80, suppress_health_check=[HealthCheck.function_scoped_fixture], deadline=None)
@given(archives=st.lists(st.tuples(entries_st, st.sampled_from(["none", "none", "flip", "size", "type", "cut"]),
                                   st.integers(0, 10**6), st.integers(0, 10**6)), min_size=1, max_size=6),
       batch=st.sampled_from([1, 3, 4096]), waiting=st.sampled_from([1, 2, 64]), skip=st.booleans(),
       want=st.sampled_from([(), ("json",)]))
def test_property_scan_many_checks_shards_together(tmp_path, monkeypatch, archives, batch, waiting, skip, want):
    """Shards whose last headers are checked in one batch: each shard's rows equal
    scan_tar's for that shard alone (or the first failing shard raises its error)."""
    from wds_pad.tar.lean import scan_many

    monkeypatch.setattr(tar_lean, "_BATCH", batch)
    monkeypatch.setattr(tar_lean, "_MAX_WAITING", waiting)
    paths = []
    for n, (entries, how, where, value) in enumerate(archives):
        names = [(kind, f"{base}.{ext}" if ext or kind != "file" else base, size) for kind, base, ext, size in entries]
        blob = _entries_tar(names, tarfile.GNU_FORMAT)
        if how != "none":
            blob = _mutate(blob, how, where, value)
        path = tmp_path / f"s{n}.tar"
        path.write_bytes(blob)
        paths.append(path)
    kw = {"want": want, "on_error": "skip" if skip else "raise"}
    expected = []
    for path in paths:
        with open(path, "rb") as f:
            gen, got = scan_tar(f, str(path), **kw), []
            try:
                while True:
                    got.append(next(gen))
            except StopIteration as stop:
                expected.append((got, stop.value))
            except TarFormatError as exc:
                expected.append(exc)
                break
    files = [open(p, "rb") for p in paths]
    try:
        if isinstance(expected[-1], Exception):
            with pytest.raises(TarFormatError) as info:
                scan_many([(f, str(p)) for f, p in zip(files, paths)], **kw)
            assert str(info.value) == str(expected[-1])
            return
        rows = scan_many([(f, str(p)) for f, p in zip(files, paths)], **kw)
    finally:
        for f in files:
            f.close()
    assert len(rows) == len(paths)
    for r, (samples, fault) in zip(rows, expected):
        assert_same_rows(r, samples)
        assert str(r.fault) == str(fault)


def test_scan_many_keeps_samples_and_errors_per_shard(tmp_path):
    """A key that ends one shard and starts the next is two samples; when several shards
    fail, the first one's error is raised, as shard-by-shard scanning would."""
    from wds_pad.tar.lean import scan_many

    def shard(name: str, members: list[tuple[bytes, bytes, dict]]) -> Path:
        path = tmp_path / name
        path.write_bytes(b"".join(_member_bytes(n, p, **kw) for n, p, kw in members) + b"\0" * 1024)
        return path

    a = shard("a.tar", [(b"b.jpg", b"1" * 10, {}), (b"a.jpg", b"2" * 10, {})])
    b = shard("b.tar", [(b"a.json", b"{}", {}), (b"c.jpg", b"3", {})])
    with open(a, "rb") as fa, open(b, "rb") as fb:
        rows = scan_many([(fa, str(a)), (fb, str(b))], want=("json",))
    assert [r.keys for r in rows] == [["b", "a"], ["a", "c"]]
    assert rows[1].sample_data(0) == {"json": b"{}"} and rows[0].length.tolist() == [1024, 1024]

    bad_sum = shard("c.tar", [(b"x.jpg", b"1", {}), (b"y.jpg", b"2", {"fix_checksum": False}), (b"z.jpg", b"3", {})])
    not_tar = tmp_path / "d.tar"
    not_tar.write_bytes(b"hello" * 300)
    with open(bad_sum, "rb") as fc, open(not_tar, "rb") as fd:
        with pytest.raises(TarFormatError, match="c.tar: invalid tar header"):
            scan_many([(fc, str(bad_sum)), (fd, str(not_tar))])


@pytest.mark.parametrize("seekable", [True, False])
def test_checksum_sum_past_two_bytes_is_not_wrapped(tmp_path, seekable):
    """A header whose byte sum passes 65535 (owner names in UTF-8, say) is checked with
    the full sum: a stored checksum equal to the sum modulo 2**16 is a bad checksum."""
    h = bytearray(_raw_header(b"s1.jpg", 3))
    h[265:297] = b"\xc3\xa9" * 16  # uname: 32 non-ASCII bytes
    h[297:329] = b"\xff" * 32  # gname
    h[346:500] = b"\xff" * 154  # after the prefix field's NUL: ignored by tarfile, summed all the same
    h[157:257] = b"\xff" * 100  # linkname: ignored for a regular file
    h[148:156] = b" " * 8
    true_sum = sum(h)
    assert true_sum >= 65536
    h[148:156] = b"%06o\0 " % (true_sum % 65536)  # wrong by 65536
    body = b"".join(_member_bytes(b"s0.%s" % e, b"x") for e in (b"jpg", b"json")) + bytes(h) + b"abc".ljust(512, b"\0")
    body += b"".join(_member_bytes(b"s2.%s" % e, b"y") for e in (b"jpg", b"json")) + b"\0" * 1024
    path = tmp_path / "wide.tar"
    path.write_bytes(body)
    with pytest.raises(TarFormatError, match="bad header checksum"):
        scan_path(path, seekable=seekable)  # scan_rows raises the same
    h[148:156] = b"%06o\0 " % true_sum  # the right sum: read like any other header
    path.write_bytes(body.replace(body[2048:2560], bytes(h)))
    assert [s.key for s in scan_path(path, seekable=seekable)] == ["s0", "s1", "s2"]


@pytest.mark.parametrize("seekable", [True, False])
def test_scan_many_reports_progress_as_it_goes(tmp_path, monkeypatch, seekable):
    """A large shard reports its samples batch by batch (a progress bar moves during
    it); the reports add up to the samples returned, up to a fault found by the general
    parser."""
    from wds_pad.tar.lean import scan_many

    monkeypatch.setattr(tar_lean, "_BATCH", 64)
    monkeypatch.setattr(tar_leanstream, "_CHUNK", 16 * 1024)
    monkeypatch.setattr(tar_leanstream, "_PROBE", 16 * 1024)
    members = [(b"s%04d.%s" % (i, e), b"p" * 100, {}) for i in range(600) for e in (b"jpg", b"json")]
    members.insert(900, (b"s0450.jpg", b"dup", {}))  # a repeated suffix: the general parser from there
    path = tmp_path / "big.tar"
    path.write_bytes(b"".join(_member_bytes(n, p, **kw) for n, p, kw in members) + b"\0" * 1024)
    reports: list[int] = []
    with open(path, "rb") as f:
        source = (f, str(path)) if seekable else (NonSeekable(path.read_bytes(), 4096), str(path))
        rows = scan_many([source], seekable=seekable, progress=reports.append, on_error="skip")[0]
    assert len(rows) == 450 and rows.fault is not None and "duplicate suffix" in str(rows.fault)
    assert sum(reports) == 450 and len(reports) > 3


def test_lean_scan_takes_over_again_after_an_odd_member(tmp_path, monkeypatch):
    """A directory entry first, one long name in the middle: the general parser reads a
    sample at each, and the lean path the rest (in seek mode); the rows stay scan_tar's."""

    entries = [("d", None)] + [(f"d/s{i:03d}.{e}", b"%d" % i * 50) for i in range(100) for e in ("jpg", "json")]
    entries[101] = ("d/" + "x" * 120 + ".jpg", b"long")
    path = write_tar(tmp_path / "dir.tar", entries)
    general: list[str] = []
    real = tar_lean.read_samples

    def counting(*a, **kw):  # noqa: ANN002, ANN003, ANN202
        for s in real(*a, **kw):
            general.append(s.key)
            yield s

    monkeypatch.setattr(tar_lean, "read_samples", counting)
    samples = scan_path(path, want=("json",))  # compares scan_rows with scan_tar
    assert len(samples) == 101 and len(general) <= 4, general


def test_lean_scan_gives_up_on_shards_of_odd_members(tmp_path, monkeypatch):
    """Every sample with a long name: after a few short turns the general parser keeps
    the shard (no numpy check per sample)."""

    entries = [(f"{'x' * 110}{i:03d}.{e}", b"%d" % i) for i in range(60) for e in ("jpg", "json")]
    path = write_tar(tmp_path / "long.tar", entries)
    turns: list[int] = []
    real = tar_lean._lean_seek
    monkeypatch.setattr(tar_lean, "_lean_seek", lambda *a, **kw: turns.append(1) or real(*a, **kw))
    assert len(scan_path(path)) == 60  # compares scan_rows with scan_tar
    assert len(turns) == 1 + tar_lean._REENTER


# ---------------------------------------------------------------- messages name the right member


def _fix_checksum(blob: bytearray, h: int) -> None:
    blob[h + 148 : h + 156] = b"%06o\0 " % (sum(blob[h : h + 148]) + 256 + sum(blob[h + 156 : h + 512]))


@pytest.mark.parametrize("seekable", [True, False])
def test_bad_header_is_named_after_its_own_member(tmp_path: Path, seekable: bool) -> None:
    """A bad checksum in the header of s1.b names s1.b (not s1.a, the member before it);
    both scanners (scan_path compares them) in both modes give the same message."""
    blob = bytearray(sample_shard(tmp_path).read_bytes())
    h = 3 * 1024  # header of s1.b (each member: one header block, one payload block)
    assert blob[h : h + 4] == b"s1.b"
    blob[h + 40] ^= 0x55  # past the name's NUL: the checksum no longer matches
    (tmp_path / "bad.tar").write_bytes(blob)
    with pytest.raises(TarFormatError, match=rf"invalid tar header \(bad header checksum\) at byte offset {h}, member 's1\.b';"):
        scan_path(tmp_path / "bad.tar", seekable=seekable)


@pytest.mark.parametrize("seekable", [True, False])
@pytest.mark.parametrize("first", ["plain", "long name"])
def test_bad_header_with_an_unreadable_name_is_placed_after_the_member_before(tmp_path: Path, seekable: bool,
                                                                               first: str) -> None:
    """Where the bad header's own name is unreadable, the message names the member before
    it -- also when the general parser starts right at it (after a long-name sample)."""
    name0 = "s0.a" if first == "plain" else "x" * 110 + ".a"
    path = write_tar(tmp_path / "t.tar", [(name0, b"0" * 300), ("s1.a", b"1" * 300), ("s2.a", b"2" * 300)])
    blob = bytearray(path.read_bytes())
    h = next(o for o in range(0, len(blob), 512) if blob[o : o + 4] == b"s1.a")
    blob[h : h + 4] = b"\x01\x02\x03\x04"  # not printable
    blob[h + 40] ^= 0x55
    (tmp_path / "bad.tar").write_bytes(blob)
    with pytest.raises(TarFormatError, match=rf"at byte offset {h}, the header after member '{name0}' "
                                             r"\(its own name is unreadable\);"):
        scan_path(tmp_path / "bad.tar", seekable=seekable)
    _fix_checksum(blob, h)  # a readable-checksum header whose name is garbage is just a member
    blob[h + 40] ^= 0x55


@pytest.mark.parametrize("seekable", [True, False])
def test_truncated_header_names_the_cut_member_when_its_name_is_there(tmp_path: Path, seekable: bool) -> None:
    blob = sample_shard(tmp_path).read_bytes()
    (tmp_path / "a.tar").write_bytes(blob[: 2048 + 100])  # the header of s1.a, name complete
    with pytest.raises(TarFormatError, match=r"truncated tar header \(100 of 512 bytes\) at byte offset 2048, member 's1\.a';"):
        scan_path(tmp_path / "a.tar", seekable=seekable)
    (tmp_path / "b.tar").write_bytes(blob[: 2048 + 2])  # the name itself is cut
    with pytest.raises(TarFormatError, match=r"\(2 of 512 bytes\) at byte offset 2048, the header after member 's0\.b'"):
        scan_path(tmp_path / "b.tar", seekable=seekable)


def _scan_message(blob: bytes, path: Path, scanner: str, seekable: bool, step: int, want: tuple[str, ...]) -> str | None:
    kw = {"want": want}
    try:
        if seekable:
            with open(path, "rb") as f:
                list(scan_tar(f, str(path), seekable=True, **kw)) if scanner == "tar" else scan_rows(f, str(path), seekable=True, **kw)
        else:
            f = NonSeekable(blob, step=step)
            list(scan_tar(f, str(path), **kw)) if scanner == "tar" else scan_rows(f, str(path), **kw)
    except TarFormatError as exc:
        return str(exc)
    return None


@settings(max_examples=120, suppress_health_check=[HealthCheck.function_scoped_fixture], deadline=None)
@given(entries=entries_st, fmt=st.sampled_from([tarfile.GNU_FORMAT, tarfile.PAX_FORMAT]),
       cut=st.integers(0, 10**6), step=st.sampled_from([7, 511, 777, 4096, 1 << 20]),
       chunk=st.sampled_from([512, 1000, 4096, 1 << 20]), want=st.sampled_from([(), ("json",), ("jpg", "txt")]))
def test_property_truncation_reported_alike_in_seek_and_stream_mode(tmp_path, monkeypatch, entries, fmt, cut, step,
                                                                   chunk, want):
    """A shard cut at any byte: seek and stream mode, general and lean scanner, report the
    same fault at the same offset -- where the file ends, or the start of the cut header."""

    monkeypatch.setattr(tar_leanstream, "_CHUNK", chunk)
    names = [(kind, f"{base}.{ext}" if ext or kind != "file" else base, size) for kind, base, ext, size in entries]
    full = _entries_tar(names, fmt)
    blob = full[: cut % (len(full) + 1)]
    path = tmp_path / "t.tar"
    path.write_bytes(blob)
    messages = {(scanner, seekable): _scan_message(blob, path, scanner, seekable, step, want)
                for scanner in ("tar", "rows") for seekable in (True, False)}
    assert len(set(messages.values())) == 1, messages
    message = messages["tar", True]
    if message is None or "truncated" not in message:
        return  # a fault of the archive itself (a repeated suffix, ...), not of the cut
    offset = int(message.split(" at byte offset ")[-1].split(",")[0].split(";")[0])
    if "truncated inside the payload" in message:
        assert offset == len(blob)
    elif "truncated tar header" in message:
        got = int(message.split("truncated tar header (")[1].split(" of")[0])
        assert offset + got == len(blob)
    else:
        assert "truncated long-name or pax header" in message and offset < len(blob)
