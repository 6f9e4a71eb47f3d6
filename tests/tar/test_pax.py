"""The indexer's lean path (wds_pad.tar.lean / leanstream / settle) on per-member pax headers.

Real shards carry a pax header before every member (webdataset's TarWriter: a float
``mtime``; ``tar --format=posix``: ``mtime``/``atime``/``ctime``). The lean path folds
such a header into the member after it when no record can change how the member is read;
every test here compares its rows -- all ScanRows columns, the member table included --
with the general parser's (scan_tar's samples, through the same accumulator), in seek
and stream mode, and checks which of the two read the pax samples.
"""

from __future__ import annotations

import io
import shutil
import subprocess
import tarfile
from pathlib import Path

import numpy as np
import pytest
import webdataset as wds
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from wds_pad.errors import TarFormatError
from wds_pad.tar import lean, leanstream
from wds_pad.tar.columns import Accumulator, ScanRows
from wds_pad.tar.lean import scan_many, scan_rows
from wds_pad.tar.scan import scan_tar

from data_helpers import NonSeekable  # noqa: E402

# ---------------------------------------------------------------- helpers


def _open(path: Path, seekable: bool, step: int):  # type: ignore[no-untyped-def]
    return open(path, "rb") if seekable else NonSeekable(path.read_bytes(), step)


def general_rows(path: Path, *, seekable: bool = True, step: int = 1 << 20,  # type: ignore[no-untyped-def]
                 **kw) -> ScanRows | Exception:
    """The rows the general parser alone gives (scan_tar's samples into the lean path's
    accumulator), or the error it raises."""
    acc = Accumulator(frozenset(kw.get("want", ())), url=str(path))
    fault = None
    with _open(path, seekable, step) as f:
        gen = scan_tar(f, str(path), seekable=seekable, **kw)
        try:
            while True:
                acc.add(next(gen))
        except StopIteration as stop:
            fault = stop.value
        except Exception as exc:  # noqa: BLE001
            return exc
    return acc.rows(str(path), fault)


def lean_rows(path: Path, *, seekable: bool = True, step: int = 1 << 20,  # type: ignore[no-untyped-def]
              **kw) -> ScanRows | Exception:
    with _open(path, seekable, step) as f:
        try:
            return scan_rows(f, str(path), seekable=seekable, **kw)
        except Exception as exc:  # noqa: BLE001
            return exc


def assert_rows_equal(got: ScanRows | Exception, want: ScanRows | Exception) -> None:
    """Every column equal (extensions compared by name: each table numbers its own)."""
    if isinstance(want, Exception) or isinstance(got, Exception):
        assert type(got) is type(want) and str(got) == str(want), (got, want)
        return
    assert got.keys == want.keys
    for col in ("offset", "length", "member_count", "member_size", "member_offset"):
        a, b = getattr(got, col), getattr(want, col)
        assert a.dtype == b.dtype and np.array_equal(a, b), col
    assert [got.sample_exts(i) for i in range(len(got))] == [want.sample_exts(i) for i in range(len(want))]
    assert [got.exts[e] for e in got.member_ext.tolist()] == [want.exts[e] for e in want.member_ext.tolist()]
    assert got.data == want.data
    assert str(got.fault) == str(want.fault)


def check(path: Path, *, steps: tuple[int, ...] = (1 << 20,), **kw) -> ScanRows:  # type: ignore[no-untyped-def]
    """Lean == general in seek mode and in stream mode (for each read size).

    Each mode is compared with the general parser in the same mode: on a shard cut
    inside the payload of a sample's first member, with on_error="skip", the general
    parser keeps the sample before it in stream mode only (it learns the file's end
    later), and the lean path follows it in each."""
    want = general_rows(path, **kw)
    assert_rows_equal(lean_rows(path, **kw), want)
    for step in steps:
        assert_rows_equal(lean_rows(path, seekable=False, step=step, **kw),
                          general_rows(path, seekable=False, step=step, **kw))
    return want  # type: ignore[return-value]


@pytest.fixture
def general_count(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Keys of the samples the general parser reads for scan_rows (its per-member step)."""
    seen: list[str] = []
    real = lean.read_samples

    def counting(*a, **kw):  # type: ignore[no-untyped-def]
        for s in real(*a, **kw):
            seen.append(s.key)
            yield s

    monkeypatch.setattr(lean, "read_samples", counting)
    return seen


def _record(key: str, value: bytes | str) -> bytes:
    """One pax record, its length counting itself."""
    body = b" " + key.encode() + b"=" + (value.encode() if isinstance(value, str) else value) + b"\n"
    n = len(body) + 1
    while len(str(n).encode() + body) != n:
        n += 1
    return str(n).encode() + body


def _header(name: bytes, size: int, kind: bytes = b"0", *, chk_delta: int = 0) -> bytes:
    h = bytearray(512)
    h[: len(name)] = name
    h[100:108], h[108:116], h[116:124] = b"0000644\0", b"0000000\0", b"0000000\0"
    h[124:136] = b"%011o\0" % size
    h[136:148] = b"%011o\0" % 1_700_000_000
    h[156:157] = kind
    h[257:265] = b"ustar\x0000"
    h[148:156] = b" " * 8
    h[148:156] = b"%06o\0 " % (sum(h) + chk_delta)
    return bytes(h)


def _block(hdr: bytes, payload: bytes) -> bytes:
    return hdr + payload + b"\0" * (-len(payload) % 512)


def _pax(records: bytes, kind: bytes = b"x", **kw) -> bytes:  # type: ignore[no-untyped-def]
    return _block(_header(b"././@PaxHeader", len(records), kind, **kw), records)


def _member(name: str, payload: bytes) -> bytes:
    return _block(_header(name.encode(), len(payload)), payload)


END = b"\0" * 1024


# ---------------------------------------------------------------- real writers


@pytest.mark.parametrize("want", [(), ("json",)])
def test_webdataset_tarwriter_defaults_are_read_by_the_lean_path(tmp_path: Path, general_count: list[str],
                                                                  want: tuple[str, ...]) -> None:
    """wds.TarWriter with its defaults (a pax mtime record before every member): the
    same rows as the general parser, and the general parser reads none of them."""
    path = tmp_path / "wds.tar"
    with wds.TarWriter(str(path)) as w:
        for i in range(300):
            w.write({"__key__": f"d{i // 100}/s{i:05d}", "bin": bytes([i % 251]) * (i * 37 % 3000),
                     "json": b'{"i": %d}' % i, "cls": b"%d" % (i % 7)})
    blob = path.read_bytes()
    assert blob[156:157] == b"x" and b"mtime=" in blob[512:1024]
    rows = check(path, want=want, head_bytes=None, steps=(777, 1 << 20))
    assert len(rows) == 300 and general_count == []
    assert rows.offset[0] == 0 and rows.member_offset[:3].tolist() == [1536, 3072, 5120]  # bin (empty), cls, json


def test_wds_shardwriter_shards(tmp_path: Path, general_count: list[str]) -> None:
    pattern = str(tmp_path / "part-%06d.tar")
    with wds.ShardWriter(pattern, maxcount=40, verbose=0) as w:
        for i in range(100):
            w.write({"__key__": f"k{i:04d}", "jpg": b"j" * (i * 91 % 1200), "txt": b"t" * i})
    paths = sorted(tmp_path.glob("part-*.tar"))
    assert len(paths) == 3
    for p in paths:
        check(p, want=("txt",), head_bytes=5)
    files = [open(p, "rb") for p in paths]
    try:  # their last headers checked together
        together = scan_many([(f, str(p)) for f, p in zip(files, paths)], want=("txt",))
    finally:
        for f in files:
            f.close()
    for r, p in zip(together, paths):
        assert_rows_equal(r, general_rows(p, want=("txt",)))
    assert general_count == []


def test_tarfile_pax_long_and_non_ascii_names_go_to_the_general_parser(tmp_path: Path,
                                                                         general_count: list[str]) -> None:
    """tarfile's pax format: a float mtime gives an mtime-only header (lean); a long or
    non-ASCII name a path record (general parser, for that sample only)."""
    path = tmp_path / "pax.tar"
    keys = [f"s{i:03d}" for i in range(40)]
    keys[5], keys[17], keys[30] = "d/" + "x" * 120, "sé17", "ü/" + "y" * 200
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tf:
        for i, key in enumerate(keys):
            for ext in ("jpg", "json"):
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.mtime = 1_700_000_000.25 if i % 3 else 1_700_000_000  # integer: no pax header
                data = b"%d" % i * (i * 13 % 300)
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
    rows = check(path, want=("json",), steps=(511, 1 << 20))
    assert rows.keys == keys
    assert general_count and not set(keys[:4]) & set(general_count)  # from the sample before the first path record


@pytest.mark.skipif(shutil.which("tar") is None, reason="needs tar")
@pytest.mark.parametrize("names", ["short", "long"])
def test_gnu_tar_posix_format(tmp_path: Path, general_count: list[str], names: str) -> None:
    """``tar --format=posix``: a ``PaxHeaders`` header with mtime/atime/ctime records
    before every member; long names add a path record (the general parser)."""
    if "GNU tar" not in subprocess.run(["tar", "--version"], capture_output=True, text=True).stdout:
        pytest.skip("needs GNU tar")
    src = tmp_path / "src"
    files = []
    for i in range(60):
        key = f"d/s{i:03d}" if names == "short" or i % 4 else f"d/{'z' * 110}{i:03d}"
        for ext in ("png", "json"):
            f = src / f"{key}.{ext}"
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_bytes(b"%d" % i * (i * 7 % 500))
            files.append(f"{key}.{ext}")
    path = tmp_path / "posix.tar"
    subprocess.run(["tar", "-c", "-f", str(path), "--format=posix", "--no-recursion", "-C", str(src), "-T", "-"],
                   input="\n".join(files).encode(), check=True)
    blob = path.read_bytes()
    assert b"PaxHeaders" in blob[:100] and blob[156:157] == b"x" and b"time=" in blob[512:1024]
    rows = check(path, want=("json",), steps=(4096,))
    assert len(rows) == 60
    if names == "short":
        assert general_count == []
    else:
        assert general_count


# ---------------------------------------------------------------- records and layouts


def _shard(tmp_path: Path, middle: bytes, name: str = "t.tar") -> Path:
    """Plain and pax samples before and after ``middle`` (the members of sample s2)."""
    before = _member("s0.jpg", b"a" * 600) + _pax(_record("mtime", "1.5")) + _member("s0.json", b"{}")
    before += _pax(_record("mtime", "2.5")) + _member("s1.jpg", b"b" * 10) + _member("s1.json", b"[]")
    after = b"".join(_pax(_record("atime", "3") + _record("ctime", "4")) + _member(f"s{i}.{e}", b"c" * i)
                     for i in (3, 4, 5) for e in ("jpg", "json"))
    path = tmp_path / name
    path.write_bytes(before + middle + after + END)
    return path


LEAN_RECORDS = [
    _record("mtime", "1712345678.123456789"),
    _record("atime", "1") + _record("ctime", "2") + _record("mtime", "3"),
    _record("uid", "1000") + _record("gid", "1000") + _record("uname", "ünïcode") + _record("gname", "g"),
    _record("comment", "anything at all = here\n with a newline"),
    _record("SCHILY.xattr.user.tag", b"\xff\x00binary"),
    _record("LIBARCHIVE.creationtime", "5"),
    b"",  # an empty pax header
]


@pytest.mark.parametrize("records", LEAN_RECORDS)
def test_records_that_do_not_change_the_member_stay_lean(tmp_path: Path, general_count: list[str],
                                                          records: bytes) -> None:
    middle = _pax(records) + _member("s2.jpg", b"x" * 700) + _pax(records) + _member("s2.json", b"{}")
    rows = check(_shard(tmp_path, middle), want=("json",), steps=(7, 1000))
    assert rows.keys == [f"s{i}" for i in range(6)] and general_count == []


ODD_PAX = {
    "path": _pax(_record("path", "s2.jpg")) + _member("other.jpg", b"x" * 700) + _member("s2.json", b"{}"),
    "path renames": _pax(_record("path", "renamed.jpg")) + _member("s2.jpg", b"x" * 700) + _member("s2.json", b"{}"),
    "size": _pax(_record("size", "3")) + _block(_header(b"s2.jpg", 3), b"xyz") + _member("s2.json", b"{}"),
    "size override": _pax(_record("size", "700")) + _header(b"s2.jpg", 0) + b"x" * 700 + b"\0" * 324
    + _member("s2.json", b"{}"),
    "linkpath": _pax(_record("linkpath", "elsewhere")) + _member("s2.jpg", b"x") + _member("s2.json", b"{}"),
    "hdrcharset": _pax(_record("hdrcharset", "BINARY")) + _member("s2.jpg", b"x") + _member("s2.json", b"{}"),
    "sparse": _pax(_record("GNU.sparse.major", "1") + _record("GNU.sparse.minor", "0"))
    + _member("s2.jpg", b"x") + _member("s2.json", b"{}"),
    "path in a value": _pax(_record("comment", "path=s9.jpg size=1")) + _member("s2.jpg", b"x")
    + _member("s2.json", b"{}"),
    "global": _pax(_record("comment", "g"), kind=b"g") + _member("s2.jpg", b"x") + _member("s2.json", b"{}"),
    "global path": _pax(_record("path", "g.jpg"), kind=b"g") + _member("s2.jpg", b"x") + _member("s2.json", b"{}"),
    "solaris X": _pax(_record("mtime", "1"), kind=b"X") + _member("s2.jpg", b"x") + _member("s2.json", b"{}"),
    "two in a row": _pax(_record("mtime", "1")) + _pax(_record("atime", "2")) + _member("s2.jpg", b"x")
    + _member("s2.json", b"{}"),
    "pax then long name": _pax(_record("mtime", "1")) + _block(_header(b"././@LongLink", 7, b"L"), b"s2.jpg\0")
    + _member("ignored", b"x") + _member("s2.json", b"{}"),
    "pax then directory": _pax(_record("mtime", "1")) + _block(_header(b"s2/", 0, b"5"), b"")
    + _member("s2.jpg", b"x") + _member("s2.json", b"{}"),
    "pax then metadata": _pax(_record("mtime", "1")) + _member("__meta__", b"m") + _member("s2.jpg", b"x"),
    "bad pax checksum": _pax(_record("mtime", "1"), chk_delta=1) + _member("s2.jpg", b"x") + _member("s2.json", b"{}"),
    "non-ASCII pax header": _block(_header(b"././@PaxHeader\xe9", 12, b"x"), _record("mtime", "1"))
    + _member("s2.jpg", b"x") + _member("s2.json", b"{}"),
    "long pax": _pax(_record("comment", "c" * 5000)) + _member("s2.jpg", b"x") + _member("s2.json", b"{}"),
    "duplicate after pax": _pax(_record("mtime", "1")) + _member("s2.jpg", b"x") + _pax(_record("mtime", "1"))
    + _member("s2.jpg", b"y"),
    "malformed records": _pax(b"99 mtime=1\n") + _member("s2.jpg", b"x") + _member("s2.json", b"{}"),
    "pax size field spaced": _block(_header(b"././@PaxHeader", 12, b"x")[:124] + b" 0000000014\0"
                                    + _header(b"././@PaxHeader", 12, b"x")[136:], _record("mtime", "1"))
    + _member("s2.jpg", b"x") + _member("s2.json", b"{}"),
}


#: The cases whose pax header the lean path may fold: the member reads the same with it.
FOLDED = {"non-ASCII pax header", "malformed records", "duplicate after pax"}


@pytest.mark.parametrize("case", sorted(ODD_PAX))
@pytest.mark.parametrize("batch", [1, 3, 4096])
def test_records_that_matter_go_to_the_general_parser(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       general_count: list[str], case: str, batch: int) -> None:
    """A pax header the lean path may not fold (a record that matters, another extension
    header before or after it, a checksum or field its checks refuse), or odd ones it
    may: the rows (or the error) are the general parser's, in both modes, with any batch
    size; the general parser reads the sample of a header the lean path may not fold."""
    monkeypatch.setattr(lean, "_BATCH", batch)
    monkeypatch.setattr(leanstream, "_CHUNK", 2048)
    path = _shard(tmp_path, ODD_PAX[case])
    want = general_rows(path, want=("json", "jpg"))
    check(path, want=("json", "jpg"), steps=(7, 513, 1 << 20))
    if isinstance(want, Exception):
        return
    assert want.keys[:2] == ["s0", "s1"]
    if case not in FOLDED:
        assert general_count and "s0" not in general_count  # from s1 (held back) or s2 on


def test_a_payload_without_records_that_matter_is_folded(tmp_path: Path, general_count: list[str]) -> None:
    """Bytes that are no records at all, but hold no path/size/sparse/hdrcharset bytes:
    the general parser (and tarfile) skip them, so the lean path folds them too."""
    path = _shard(tmp_path, _pax(b"garbage") + _member("s2.jpg", b"x") + _member("s2.json", b"{}"))
    rows = check(path, want=("json",))
    assert rows.keys == [f"s{i}" for i in range(6)] and general_count == []


@pytest.mark.parametrize("tail", [b"", END, b"\0" * 512, b"\0" * 300])
def test_a_pax_header_last_in_the_archive(tmp_path: Path, tail: bytes) -> None:
    """A pax header with no member after it (end of file, an end block, a cut block):
    the general parser's fault or samples, at the same offsets."""
    path = tmp_path / "last.tar"
    path.write_bytes(_member("s0.jpg", b"a") + _pax(_record("mtime", "1")) + _member("s1.jpg", b"b")
                     + _pax(_record("mtime", "2")) + tail)
    for skip in ("raise", "skip"):
        check(path, on_error=skip, steps=(7, 512, 1 << 20))
    rows = general_rows(path, on_error="skip")
    assert not isinstance(rows, Exception) and rows.fault is not None


def test_cut_inside_a_pax_payload(tmp_path: Path) -> None:
    full = _shard(tmp_path, b"").read_bytes()
    for cut in range(0, len(full), 97):
        path = tmp_path / "cut.tar"
        path.write_bytes(full[:cut])
        check(path, on_error="skip", steps=(100, 1 << 20))


def test_too_many_extensions_with_pax_headers_checked_together(tmp_path: Path) -> None:
    """Two shards of 40 extensions each, checked in one batch (80 together): each is
    checked on its own again, with its own pax headers."""
    paths = []
    for n in range(2):
        path = tmp_path / f"e{n}.tar"
        path.write_bytes(b"".join(_pax(_record("mtime", f"{n}.{i}")) + _member(f"s{i:03d}.e{n}x{i:02d}", b"p")
                                  for i in range(40)) + END)
        paths.append(path)
    files = [open(p, "rb") for p in paths]
    try:
        rows = scan_many([(f, str(p)) for f, p in zip(files, paths)])
    finally:
        for f in files:
            f.close()
    for r, p in zip(rows, paths):
        assert_rows_equal(r, general_rows(p))
        assert len(r.exts) == 40


# ---------------------------------------------------------------- the property

_RECORD_SETS = [
    None, None, None,  # a plain member
    _record("mtime", "1712345678.5"),
    _record("atime", "1") + _record("ctime", "2"),
    _record("uname", "ü") + _record("comment", "x=y"),
    _record("path", "renamed.jpg"),
    _record("size", "5"),
    _record("comment", "path=z"),
    _record("hdrcharset", "BINARY"),
    b"7 m=1\n" + b"junk",
]

member_st = st.tuples(
    st.sampled_from(["a", "b", "c", "d/e", "f.g/h", "__m__", "é"]),
    st.sampled_from(["jpg", "json", "JSON", "txt", ""]),
    st.integers(0, 1300),
    st.sampled_from(range(len(_RECORD_SETS))),
    st.sampled_from(["x", "x", "x", "xx", "g", "dir"]),
)


def _archive(members: list[tuple[str, str, int, int, str]]) -> bytes:
    out = []
    for base, ext, size, rec, kind in members:
        records = _RECORD_SETS[rec]
        if kind == "dir":
            out.append(_block(_header(base.encode() + b"/", 0, b"5"), b""))
        if records is not None:
            if kind == "xx":
                out.append(_pax(_record("mtime", "9")))
            out.append(_pax(records, kind=b"g" if kind == "g" else b"x"))
        name = f"{base}.{ext}" if ext else base
        payload = bytes([size % 251]) * size
        if records is not None and b"size=" in records:
            payload = payload[:5].ljust(5, b"s")  # what the override says
            out.append(_header(name.encode(), size) + payload + b"\0" * 507)
        else:
            out.append(_member(name, payload))
    return b"".join(out) + END


@settings(max_examples=200, suppress_health_check=[HealthCheck.function_scoped_fixture], deadline=None)
@given(shards=st.lists(st.tuples(st.lists(member_st, max_size=16), st.integers(0, 10**6)), min_size=1, max_size=4),
       cut=st.booleans(), batch=st.sampled_from([1, 2, 3, 4096]), chunk=st.sampled_from([512, 1000, 4096, 1 << 20]),
       step=st.sampled_from([7, 777, 1 << 20]), waiting=st.sampled_from([1, 2, 64]),
       want=st.sampled_from([(), ("json",), ("json", "jpg")]), head=st.none() | st.integers(0, 40),
       skip=st.booleans())
def test_property_pax_mixes_lean_equals_general(tmp_path, monkeypatch, shards, cut, batch, chunk, step, waiting,
                                                want, head, skip):
    """Random mixes of plain members and pax headers of every kind (folded, refused,
    global, two in a row, malformed), optionally cut anywhere: per shard, scan_rows and
    scan_many give the general parser's rows (every column) or its exact error, in seek
    and stream mode, with any batch, read and buffer size."""
    monkeypatch.setattr(lean, "_BATCH", batch)
    monkeypatch.setattr(leanstream, "_CHUNK", chunk)
    monkeypatch.setattr(lean, "_MAX_WAITING", waiting)
    kw = {"want": want, "head_bytes": head, "on_error": "skip" if skip else "raise"}
    paths = []
    for n, (members, where) in enumerate(shards):
        blob = _archive(members)
        if cut:
            blob = blob[: where % (len(blob) + 1)]
        path = tmp_path / f"p{n}.tar"
        path.write_bytes(blob)
        paths.append(path)
    expected = [general_rows(p, **kw) for p in paths]
    for p, want_rows in zip(paths, expected):
        assert_rows_equal(lean_rows(p, **kw), want_rows)
        assert_rows_equal(lean_rows(p, seekable=False, step=step, **kw),
                          general_rows(p, seekable=False, step=step, **kw))
    first_error = next((e for e in expected if isinstance(e, Exception)), None)
    files = [open(p, "rb") for p in paths]
    try:
        try:
            together: list[ScanRows] | Exception = scan_many([(f, str(p)) for f, p in zip(files, paths)], **kw)
        except TarFormatError as exc:
            together = exc
    finally:
        for f in files:
            f.close()
    if first_error is not None:
        assert isinstance(together, Exception) and str(together) == str(first_error)
    else:
        assert not isinstance(together, Exception)
        for r, want_rows in zip(together, expected):
            assert_rows_equal(r, want_rows)


def test_wds_tarwriter_real_clock_mtime(tmp_path: Path, general_count: list[str]) -> None:
    """The clock's float mtime (what a real TarWriter writes), with a .json and a large member."""
    path = tmp_path / "clock.tar"
    with wds.TarWriter(str(path)) as w:
        for i in range(50):
            w.write({"__key__": f"{i:06d}", "npy": b"n" * (70_000 if i % 10 == 0 else 900), "json": b"{}"})
    check(path, want=("json",), steps=(1 << 20,))
    assert general_count == []


@pytest.mark.parametrize("cut", [None, 3000, 3584, 4000])
@pytest.mark.parametrize("chunk", [512, 1536, 4096])
def test_two_pax_headers_last_on_a_stream_buffer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 cut: int | None, chunk: int) -> None:
    """Two pax headers in a row where a stream buffer's run of headers ends: neither is
    folded there (the member after them is not on the run)."""
    monkeypatch.setattr(lean, "_BATCH", 1)
    monkeypatch.setattr(leanstream, "_CHUNK", chunk)
    blob = _archive([("a", "jpg", 513, 3, "x"), ("a", "json", 1, 3, "xx"), ("b", "jpg", 5, 3, "x")])
    path = tmp_path / "xx.tar"
    path.write_bytes(blob if cut is None else blob[:cut])
    check(path, steps=(7, 1 << 20))
