"""The member-table check of the fast path (wds_pad.tar.names): in every header form a
producer writes, a sample is sliced as the parser and webdataset read it; a member header
rewritten in place (a new size within its padding, a new extension, a new key: the shard's
size kept) is a StaleShardError naming the sample and what changed; the tokens spell
the common form."""

from __future__ import annotations

import io
import json
import os
import tarfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import webdataset as wds

from wds_pad.cli.producers import write_samples
from wds_pad.errors import StaleShardError
from wds_pad.tar import names
from wds_pad.tar.members import key_bytes
from wds_pad.tar.names import member_entry, name_tokens, size_tokens, slice_sample, slice_sample_at
from wds_pad.tar.scan import ScannedSample, parse_sample, scan_tar

from data_helpers import rewrite_member_header, write_pax_raw_path  # noqa: E402

# form -> (producer, key of sample i, extension of its 1000-byte member); "pax-raw-path" is
# made by hand (a pax path that is not UTF-8, without hdrcharset, as GNU tar <= 1.23 wrote)
FORMS: dict[str, tuple[str, str, str]] = {
    "ustar": ("tarfile-ustar", "k{:03d}", "bin"),
    "pax-per-member": ("webdataset", "k{:03d}", "bin"),  # wds.TarWriter: a pax mtime header each
    "gnu": ("tarfile-gnu", "k{:03d}", "bin"),
    "ustar-prefix": ("tarfile-ustar", "dir.v1/" + "p" * 90 + "/k{:03d}", "bin"),
    "pax-non-ascii": ("tarfile-pax", "caf\u00e9-{:03d}", "bin"),
    "pax-long": ("tarfile-pax", "l" * 130 + "{:03d}", "bin"),
    "gnu-long": ("tarfile-gnu", "g" * 130 + "{:03d}", "bin"),
    "wds-long": ("webdataset", "w" * 130 + "{:03d}", "bin"),  # a pax path and mtime record each
    "ustar-non-utf8": ("tarfile-ustar", "k\udcff{:03d}", "bin"),
    "pax-binary": ("tarfile-pax", "k\udcff{:03d}", "bin"),  # hdrcharset=BINARY
    "pax-raw-path": ("", "k\udcfe{:03d}", "bin"),
    "upper-ext": ("tarfile-ustar", "k{:03d}", "BIN"),
}
COMMON = ("ustar", "pax-per-member", "gnu", "ustar-non-utf8")  # the tokens cover them: no header parsed
# what the usual writers write, beyond the tokens (long or non-ASCII names, a ustar prefix, an
# uppercase extension): compared as bytes
LONG = ("pax-non-ascii", "pax-long", "gnu-long", "wds-long", "pax-binary", "ustar-prefix", "upper-ext")


def _shard(tmp: Path, form: str) -> tuple[Path, list[ScannedSample]]:
    producer, key, ext = FORMS[form]
    samples = [{"__key__": key.format(i), ext: os.urandom(1000), "json": json.dumps({"i": i}).encode()}
               for i in range(3)]
    if producer:
        path = Path(write_samples(tmp, [samples], producer)[0])
    else:
        path = Path(write_pax_raw_path(tmp / "shard-000000.tar", samples))
    with open(path, "rb") as f:
        scanned = list(scan_tar(f, str(path)))
    assert [s.key for s in scanned] == [s["__key__"] for s in samples]
    return path, scanned


def _entry(s: ScannedSample) -> names.Members:
    return member_entry(s.key, [m.ext for m in s.members], [m.data_offset - 512 - s.offset for m in s.members],
                        [m.size for m in s.members])


def _sliced_at(path: Path, s: ScannedSample, entry: names.Members) -> dict[str, bytes]:
    fd = os.open(path, os.O_RDONLY)
    try:
        return slice_sample_at(fd, str(path), s.offset, s.key, entry)
    finally:
        os.close(fd)


@pytest.mark.parametrize("form", FORMS)
def test_every_form_slices_as_webdataset_reads_it(tmp_path: Path, form: str, monkeypatch: pytest.MonkeyPatch) -> None:
    path, scanned = _shard(tmp_path, form)
    compared: list[str] = []  # members the tokens did not cover, compared as a long name's bytes
    parsed: list[str] = []  # members whose headers were parsed
    real_long, real_parse = names._spelled_as_written, names.member_name_size
    monkeypatch.setattr(names, "_spelled_as_written", lambda d, *a: compared.append(a[3]) or real_long(d, *a))
    monkeypatch.setattr(names, "member_name_size", lambda *a: parsed.append(a[2]) or real_parse(*a))
    blob = path.read_bytes()
    reference = {d["__key__"]: d for d in wds.WebDataset(str(path), shardshuffle=False)}
    for s in scanned:
        data = blob[s.offset : s.offset + s.length]
        want = {k: v for k, v in reference[s.key].items() if not k.startswith("__")}
        assert slice_sample(data, str(path), s.offset, s.key, _entry(s)) == want
        assert _sliced_at(path, s, _entry(s)) == want == parse_sample(data, str(path), s.offset, s.key)
    assert bool(compared) == (form not in COMMON) and bool(parsed) == (form not in COMMON + LONG), (compared, parsed)


@pytest.mark.parametrize("how", ["size", "ext", "key"])
@pytest.mark.parametrize("form", FORMS)
def test_a_header_rewritten_in_place_is_stale(tmp_path: Path, form: str, how: str) -> None:
    path, scanned = _shard(tmp_path, form)
    s = scanned[1]
    blob = bytearray(path.read_bytes())
    size = len(blob)
    reason = {"size": "now holds 1010 bytes, 1000 indexed", "ext": "is now named", "key": "names member"}[how]
    rewrite_member_header(blob, next(m for m in s.members if m.size == 1000), how)
    assert len(blob) == size
    path.write_bytes(blob)
    # webdataset reads the rewrite: 1010 bytes, a "bix" member, a member of another key
    seen = list(wds.WebDataset(str(path), shardshuffle=False))
    if how == "size":
        assert len(seen[1]["bin"]) == 1010
    elif how == "ext":
        assert "bix" in seen[1] and "bin" not in seen[1]
    else:
        assert [[k for k in d if not k.startswith("__")] for d in seen if d["__key__"] == s.key] == [["json"]]
    data = bytes(blob[s.offset : s.offset + s.length])
    for read in (lambda e: slice_sample(data, str(path), s.offset, s.key, e), lambda e: _sliced_at(path, s, e)):
        with pytest.raises(StaleShardError) as info:
            read(_entry(s))
        message = str(info.value)
        assert repr(s.key) in message and reason in message and str(path) in message
        assert f"--rescan {path}" in message
    # the other samples still read as indexed
    for t in (scanned[0], scanned[2]):
        assert slice_sample(bytes(blob[t.offset : t.offset + t.length]), str(path), t.offset, t.key, _entry(t))


def test_a_payload_past_the_range_is_stale(tmp_path: Path) -> None:
    path, (s, *_) = _shard(tmp_path, "ustar")
    data = path.read_bytes()[s.offset : s.offset + s.length]
    exts, heads, sizes, ntoks, stoks = _entry(s)
    with pytest.raises(StaleShardError, match="runs past"):
        slice_sample(data[: heads[-1] + 516], str(path), s.offset, s.key, (exts, heads, sizes, ntoks, stoks))


def test_tokens_spell_the_common_form() -> None:
    keys = ["a", "bbbbbbbbbb", "k\udcff1", "x" * 94, "y" * 95, "c" * 3]  # the last at the table's very end
    exts = ["bin", "json", "longer.ext"]
    blob = b"".join(map(key_bytes, keys))
    ends = np.cumsum([len(key_bytes(k)) for k in keys])
    starts = ends - [len(key_bytes(k)) for k in keys]
    counts = np.array([2, 1, 3, 1, 1, 2])
    ext_ids = np.array([0, 1, 2, 0, 1, 0, 1, 1, 2, 1])
    got = name_tokens(np.frombuffer(blob, np.uint8), starts, ends, counts, ext_ids, exts)
    it = iter(ext_ids.tolist())
    want = [key_bytes(k) + b"." + exts[next(it)].encode() for k, c in zip(keys, counts) for _ in range(c)]
    assert got == [n.ljust(100, b"\0") if len(n) < 100 else () for n in want]
    assert got[6] != () and got[7] == ()  # 99 bytes and its NUL fill the field; 100 leave no room
    sizes = [0, 1, 1000, 8**11 - 1, 8**11, 2**40]
    tokens = size_tokens(np.array(sizes))
    assert tokens[:4] == [b"%011o\0" % n for n in sizes[:4]]
    assert all(len(t) == 12 and t[-1:] != b"\0" for t in tokens[4:])  # no such spelling: never matches
    short = name_tokens(np.frombuffer(b"k1", np.uint8), np.array([0]), np.array([2]), np.array([1]), np.array([0]),
                        ["json"])
    assert short == [b"k1.json\0"]
    assert name_tokens(np.zeros(0, np.uint8), np.zeros(0), np.zeros(0), np.zeros(0), np.zeros(0), exts) == []


def test_member_entry_of_a_tarfile_member(tmp_path: Path) -> None:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tf:
        info = tarfile.TarInfo("k.json")
        info.size = 2
        tf.addfile(info, io.BytesIO(b"{}"))
    header = buf.getvalue()[:512]
    exts, heads, sizes, ntoks, stoks = member_entry("k", ["json"], [0], [2])
    assert header.startswith(ntoks[0]) and header.startswith(stoks[0], 124)


def _raw(name: bytes, size_field: bytes, kind: bytes = b"0", prefix: bytes = b"") -> bytes:
    h = bytearray(512)
    h[: len(name)] = name
    h[100:108], h[108:116], h[116:124] = b"0000644\0", b"0000000\0", b"0000000\0"
    h[124:136], h[136:148], h[156:157], h[257:265] = size_field, b"%011o\0" % 0, kind, b"ustar\x0000"
    h[345 : 345 + len(prefix)] = prefix
    h[148:156] = b" " * 8
    h[148:156] = b"%06o\0 " % sum(h)
    return bytes(h)


def _rec(keyword: str, value: str) -> bytes:
    """One pax record, its length counting itself."""
    body = f" {keyword}={value}\n".encode()
    n = len(body) + len(str(len(body)))
    n += len(str(n)) - len(str(len(body)))
    return b"%d" % n + body


def _ext(kind: bytes, payload: bytes) -> bytes:
    return _raw(b"././@LongLink" if kind == b"L" else b"PaxHeader", b"%011o\0" % len(payload), kind) + \
        payload + bytes(-len(payload) % 512)


@pytest.mark.parametrize("layout", [
    [_raw(b"k.bin", b"%011o\0" % 3)],
    [_raw(b"k.bin", b"\x80" + (3).to_bytes(11, "big"))],  # base-256
    [_raw(b"k.bin", b"3" + b" " * 11)],  # another spelling of the number
    [_raw(b"k.bin", b"%011o\0" % 3, prefix=b"a/b")],
    [_raw(b"k.bin", b"%011o\0" % 3, kind=b"\0")],
    [_raw(b"k/", b"%011o\0" % 0, kind=b"\0")],  # a directory in old style: not a regular member
    [_raw(b"k.bin", b"%011o\0" % 0, kind=b"2")],  # a symlink
    [_ext(b"L", b"long/name.bin\0"), _raw(b"stand-in", b"%011o\0" % 3)],
    [_ext(b"x", _rec("path", "p/k.bin")), _raw(b"stand-in", b"%011o\0" % 3)],
    [_ext(b"x", _rec("path", "p/k.bin") + _rec("size", "3")), _raw(b"stand-in", b"%011o\0" % 0)],  # a pax size
    [_ext(b"x", _rec("size", "x2")), _raw(b"k.bin", b"%011o\0" % 3)],  # malformed: tarfile reads 0
    [_ext(b"x", _rec("GNU.sparse.size", "3")), _raw(b"k.bin", b"%011o\0" % 3)],  # sparse
    [_ext(b"x", b"0 path=x\n"), _raw(b"k.bin", b"%011o\0" % 3)],  # a record of length 0
    [_ext(b"L", b"k.bin\0"), _ext(b"x", _rec("mtime", "1.5")), _raw(b"k.bin", b"%011o\0" % 3)],  # two headers
    [_ext(b"g", _rec("mtime", "1.5")), _raw(b"k.bin", b"%011o\0" % 3)],  # a global header
])
def test_member_name_size_reads_as_read_entry_or_leaves_it_to_it(layout: list[bytes]) -> None:
    """The common layouts give read_entry's name and size; any other is None (read_entry
    reads it): never another answer."""
    from wds_pad.errors import TarFormatError
    from wds_pad.tar.headers import member_name_size, read_entry
    from wds_pad.tar.reader import Reader

    data = b"".join(layout) + b"abc" + bytes(509) + bytes(1024)
    h = len(b"".join(layout)) - 512
    got = member_name_size(data, 0, h)
    try:
        e = read_entry(Reader(None, "x", True, data), 0, None)
        want = (e[4], e[2]) if e is not None and e[5] else None
    except TarFormatError:
        want = None
    assert got is None or got == want, (got, want)
    simple = len(layout) == 1 or (len(layout) == 2 and layout[0][156:157] in (b"L", b"x"))
    if simple and want is not None and b"sparse" not in layout[0] and b"0 path" not in layout[0]:
        assert got == want  # the common layouts are read here, not left to read_entry
