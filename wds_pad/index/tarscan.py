"""Tar header scanning and webdataset sample grouping, one byte range per sample.

``scan_tar`` walks a shard's headers (seeking past payloads when the file can seek,
reading through in 1 MiB chunks when it cannot) and yields one :class:`ScannedSample`
per webdataset sample; ``parse_sample`` turns the bytes of one recorded range back into
the sample's ``{ext: payload}``.

Invariants:
    * Grouping matches ``wds.WebDataset(url)`` exactly: only regular members count
      (``tarfile``'s ``isreg``); ``__*__`` metadata members and names without an
      extension are skipped; key and extension come from webdataset's
      ``base_plus_ext`` regex, the extension lowercased; consecutive members with the
      same key form a sample; a sample holding a non-empty ``__bad__`` member is dropped;
      a repeated extension within a sample is an error.
    * Header semantics follow ``tarfile``: ustar prefix, GNU ``L``/``K`` long names,
      pax ``x`` ``path``/``size`` overrides (outermost header wins), base-256 numbers,
      signed or unsigned checksums, the first zero block ends the archive, EOF exactly at
      a header boundary ends it too. Sparse members, compressed shards and global pax
      headers that override ``path`` or ``size`` are rejected: they have no faithful
      contiguous byte range.
    * A sample's range ``[offset, offset + length)`` starts at the first header block of
      its first member (long-name and pax blocks included) and ends at the 512-padded end
      of its last member's payload; it parses on its own with ``parse_sample``.
    * Seek mode and stream mode yield identical samples.
"""

from __future__ import annotations

import enum
import logging
import os
import re
import stat
import struct
import sys
import zlib
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from typing import BinaryIO

from wds_pad.errors import ConfigError, ShardError, StaleShardError, TarFormatError

__all__ = ["Member", "OnError", "ScannedSample", "parse_sample", "parse_sample_at", "scan_tar", "split_key"]

_log = logging.getLogger(__name__)

_BLOCK = 512
_CHUNK = 1 << 20  # stream mode read size
_WINDOW = 4096  # seek mode read size: a header plus a small payload (json) in one read
_ENC = sys.getfilesystemencoding()  # what tarfile (and so webdataset) decodes names with
_KEY_RE = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")  # webdataset's base_plus_ext
_SKIP_META_RE = re.compile(r"__[^/]*__($|/)")  # webdataset's tar_file_iterator skip_meta
_PAX_RE = re.compile(rb"(\d+) ([^=]+)=")  # tarfile's pax record pattern
_PAX_KEYS = re.compile(rb"path=|size=|sparse")  # pax records that matter here (others: mtime, ...)
_REGULAR = frozenset((b"0", b"\0", b"7"))  # tarfile REGULAR_TYPES minus sparse "S"
_NO_PAYLOAD = frozenset((b"1", b"2", b"3", b"4", b"5", b"6"))  # links, devices, dirs, fifos
# name, size, chksum, typeflag, first byte of the ustar prefix
_FIELDS = struct.Struct("100s24x12s12x8sc188xB")
_EXTENSION = frozenset((b"L", b"K", b"x", b"X", b"g"))  # headers that describe the next one
_RESERVED_EXTS = frozenset(("__key__", "__url__"))  # already in every webdataset sample
_HINT = "re-create the shard, or index with on_error='skip' to keep the samples before the fault"
_COMPRESSED = ((b"\x1f\x8b", "gzip"), (b"BZh", "bzip2"), (b"\xfd7zXZ", "xz"), (b"\x28\xb5\x2f\xfd", "zstd"))


class OnError(enum.Enum):
    """What ``scan_tar`` does when a shard is not a valid tar archive."""

    RAISE = "raise"
    SKIP = "skip"


@dataclass(frozen=True, slots=True)
class Member:
    """One regular tar member that belongs to a sample.

    Built only by the parser, millions of times per index, so it skips validation.

    Attributes:
        name: Full member path in the archive.
        ext: Suffix as webdataset names it (after the first dot of the file name,
            lowercased).
        header_offset: Offset of the member's first header block (long-name and pax
            blocks included).
        data_offset: Offset of the member's payload.
        size: Payload size in bytes.
    """

    name: str
    ext: str
    header_offset: int
    data_offset: int
    size: int


@dataclass(frozen=True, slots=True)
class ScannedSample:
    """One webdataset sample and the contiguous byte range that holds it.

    Attributes:
        key: The webdataset ``__key__``.
        offset: Byte offset of the first header block of the sample's first member.
        length: Bytes up to the end of the last member's 512-padded payload.
        members: The sample's members in archive order.
        data: Payloads of the requested extensions (possibly only their first bytes).
    """

    key: str
    offset: int
    length: int
    members: tuple[Member, ...]
    data: dict[str, bytes] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.offset < 0 or self.offset % _BLOCK or self.length < _BLOCK or self.length % _BLOCK:
            raise ConfigError(
                f"sample {self.key!r}: offset {self.offset} and length {self.length} must be "
                f"non-negative multiples of {_BLOCK} (length at least one block)"
            )
        if not self.members:
            raise ConfigError(f"sample {self.key!r} at offset {self.offset} has no members")


def split_key(name: str) -> tuple[str, str] | None:
    """Split a member name into webdataset's (key, suffix), like ``base_plus_ext``.

    The suffix is everything after the first dot of the file name, not lowercased.

    Args:
        name: Member path, e.g. ``"a.b/c.seg.png"``.

    Returns:
        ``("a.b/c", "seg.png")``, or ``None`` when the file name has no extension.
    """
    m = _KEY_RE.match(name)
    return None if m is None else (m.group(1), m.group(2))


def _is_meta(name: str) -> bool:
    """Whether webdataset's tar_file_iterator skips the member as metadata."""
    if "/" not in name and name.endswith("__"):
        return True
    return _SKIP_META_RE.match(name) is not None


def _nts(b: bytes) -> str:
    p = b.find(b"\0")
    return (b if p < 0 else b[:p]).decode(_ENC, "surrogateescape")


def _num(b: bytes) -> int:
    """A numeric header field as tarfile reads it (octal text or base-256)."""
    if b[0] in (0o200, 0o377):  # base-256
        n = int.from_bytes(b[1:], "big")
        return n - 256 ** (len(b) - 1) if b[0] == 0o377 else n
    p = b.find(0)
    try:
        return int(b if p < 0 else b[:p], 8)  # int() strips blanks like tarfile's nti
    except ValueError:
        if not (b if p < 0 else b[:p]).strip():
            return 0
        raise ValueError(f"invalid number field {bytes(b)!r}") from None


def _checksum_ok(hdr: bytes, total: int) -> bool:
    """Check the header checksum; ``total`` is the exact sum of all 512 bytes."""
    stored = _num(hdr[148:156])
    unsigned = total - sum(hdr[148:156]) + 256
    if stored == unsigned:
        return True
    high = sum(1 for i, c in enumerate(hdr) if c >= 128 and not 148 <= i < 156)
    return stored == unsigned - 256 * high  # tarfile also accepts a signed-char sum


def _not_a_tar(r: _Reader, head: bytes, why: str) -> TarFormatError:
    for magic, comp in _COMPRESSED:
        if head.startswith(magic):
            return _fault(r.url, 0, f"{comp}-compressed shard (byte ranges need an uncompressed tar)")
    return _fault(r.url, 0, f"not a tar archive ({why})")


def _checked(r: _Reader, pos: int, hdr: bytes, total: int, name: str | None, prev: _Entry | None) -> int:
    """Verify a header by tarfile's rules; return its size or raise TarFormatError.

    ``name`` is the member's name from a long-name or pax header before it, if any;
    ``prev`` the entry before (named when this header's own name is unreadable)."""
    try:
        if not _checksum_ok(hdr, total):
            raise ValueError("bad header checksum")
        size = _num(hdr[124:136])
        if size < 0:
            raise ValueError(f"negative size {size}")
        return size
    except ValueError as exc:
        if pos == 0:
            raise _not_a_tar(r, hdr, str(exc)) from exc
        raise _bad_header(r, pos, f"invalid tar header ({exc})", name or _header_name(hdr), prev) from exc


def _pax(buf: bytes) -> dict[str, str]:
    """Pax records as tarfile parses them."""
    out: dict[str, str] = {}
    pos = 0
    while (m := _PAX_RE.match(buf, pos)) is not None:
        length = int(m.group(1))
        if length == 0:
            raise ValueError("pax record of length 0")
        value = buf[m.end(2) + 1 : m.start(1) + length - 1]
        out[m.group(2).decode("utf-8", "surrogateescape")] = value.decode(_ENC, "surrogateescape")
        pos += length
    return out


def _fault(url: str, offset: int, what: str, *, name: str | None = None, key: str | None = None,
           after: str | None = None) -> TarFormatError:
    where = "".join((f", member {name!r}" if name else "",
                     f", the header after member {after!r} (its own name is unreadable)" if after and not name else "",
                     f", sample key {key!r}" if key else ""))
    return TarFormatError(f"{url}: {what} at byte offset {offset}{where}; {_HINT}")


def _header_name(hdr: bytes) -> str | None:
    """The member name a (possibly damaged or cut) header block spells, if it is readable:
    complete, non-empty and printable."""
    field = hdr[:100]
    end = field.find(0)
    if end < 0 and len(hdr) < 100:
        return None  # cut inside the name
    raw = field if end < 0 else field[:end]
    if not raw:
        return None
    name = raw.decode(_ENC, "surrogateescape")
    if len(hdr) >= 500 and hdr[345]:
        name = f"{_nts(hdr[345:500])}/{name}"
    return name if name.isprintable() else None


def _bad_header(r: _Reader, pos: int, what: str, name: str | None, prev: _Entry | None) -> TarFormatError:
    """A fault in the header at ``pos``: named after its member, or after the entry before."""
    return _fault(r.url, pos, what, name=name, after=None if name or prev is None else prev[4])


def _cut(r: _Reader, name: str | None, data: int, size: int, nxt: int, got: int = -1) -> TarFormatError:
    """The archive ends inside a member's payload (or its padding): the same message in
    seek and stream mode, at the offset where the file ends."""
    end = r.eof if r.eof >= 0 else data + max(got, 0)
    return _fault(r.url, end, f"truncated inside the payload ({size} bytes at byte offset {data}, padded to "
                              f"{nxt}): the file ends", name=name)


class _Reader:
    """Bytes of a shard at absolute offsets, with a read-ahead buffer.

    ``at(off, n)`` is short only at end of file; ``eof`` is the file size once known
    (from the start in seek mode, when the stream runs dry in stream mode), else -1.
    """

    __slots__ = ("_f", "_fd", "_buf", "_base", "_seek", "url", "eof")

    def __init__(self, f: BinaryIO | None, url: str, seek: bool, data: bytes = b"") -> None:
        self._f, self.url, self._seek = f, url, seek
        self._fd = -1
        self._buf, self._base, self.eof = data, 0, len(data) if f is None else -1
        if f is None or not seek:
            return
        try:
            fd = f.fileno()
            st = os.fstat(fd)
            if stat.S_ISREG(st.st_mode):
                self._fd, self.eof = fd, st.st_size
        except (AttributeError, OSError, ValueError):
            pass
        if self._fd < 0:
            self.eof = self._io(lambda: f.seek(0, os.SEEK_END), 0)

    def _io(self, call, offset: int):  # type: ignore[no-untyped-def]
        try:
            return call()
        except OSError as exc:
            raise ShardError(f"{self.url}: reading at byte offset {offset} failed: {exc}") from exc

    def at(self, off: int, n: int) -> bytes:
        rel = off - self._base
        if rel >= 0 and rel + n <= len(self._buf):
            return self._buf[rel : rel + n]
        if self._f is None:
            return self._buf[max(rel, 0) : rel + n] if rel < len(self._buf) else b""
        return self._fill_seek(off, n) if self._seek else self._fill_stream(off, n)

    def _fill_seek(self, off: int, n: int) -> bytes:
        want = max(n, _WINDOW)
        if self._fd >= 0:
            parts = [self._io(lambda: os.pread(self._fd, want, off), off)]
        else:
            self._io(lambda: self._f.seek(off), off)  # type: ignore[union-attr]
            parts = [self._io(lambda: self._f.read(want), off)]  # type: ignore[union-attr]
        got = len(parts[0])
        while parts[-1] and got < want and off + got < self.eof:  # short reads before EOF
            if self._fd >= 0:
                parts.append(self._io(lambda: os.pread(self._fd, want - got, off + got), off + got))
            else:
                parts.append(self._io(lambda: self._f.read(want - got), off + got))  # type: ignore[union-attr]
            got += len(parts[-1])
        self._buf, self._base = b"".join(parts) if len(parts) > 1 else parts[0], off
        return self._buf[:n]

    def _fill_stream(self, off: int, n: int) -> bytes:
        buf, base, read = self._buf, self._base, self._f.read  # type: ignore[union-attr]
        end = base + len(buf)
        if off < base:
            raise RuntimeError(f"stream reader asked to go back from {base} to {off}")
        if off < end:
            parts, base = [buf[off - base :]], off
        else:  # drop whole chunks until one reaches `off`; it becomes the buffer, uncopied
            parts = []
            while self.eof < 0:
                chunk = self._io(lambda: read(_CHUNK), end)
                if not chunk:
                    self.eof = end
                elif end + len(chunk) > off:
                    parts, base = [chunk], end
                    end += len(chunk)
                    break
                end += len(chunk)
            if not parts:
                self._buf, self._base = b"", end
                return b""
        have = end - off
        while have < n and self.eof < 0:
            chunk = self._io(lambda: read(max(_CHUNK, n - have)), end)
            if not chunk:
                self.eof = end
            parts.append(chunk)
            have += len(chunk)
            end += len(chunk)
        self._buf, self._base = b"".join(parts) if len(parts) > 1 else parts[0], base
        rel = off - base
        return self._buf[rel : rel + n]


# (header_offset, data_offset, size, next_header_offset, name, is_regular)
_Entry = tuple[int, int, int, int, str, bool]


def _end_of_data(r: _Reader, pos: int, start: int, got: int, name: str | None, prev: _Entry | None) -> None:
    """Raise unless a short read at header ``pos`` is the clean end of the archive."""
    if pos == start and not got and pos == r.eof and pos:
        return  # EOF right at a header boundary ends the archive, as in tarfile
    if pos == 0:
        head = r.at(0, _BLOCK)
        if not head:
            raise _fault(r.url, 0, "empty file, not a tar archive")
        raise _not_a_tar(r, head, f"only {len(head)} bytes")
    if not got and 0 <= r.eof < pos:
        if prev is not None and prev[3] == pos:  # the entry before runs past the end
            raise _cut(r, prev[4], prev[1], prev[2], prev[3])
        raise _fault(r.url, r.eof, f"truncated inside the payload of the member before offset {pos}")
    header = r.at(pos, got)
    raise _bad_header(r, pos, f"truncated tar header ({got} of {_BLOCK} bytes)",
                      name if name is not None else _header_name(header), prev)


def _entry(r: _Reader, pos: int, prev: _Entry | None) -> _Entry | None:
    """Read the archive entry starting at ``pos``; ``None`` at the end of the archive.

    ``prev`` is the entry before it, if known (for messages)."""
    start, name, size_override, adler, unpack = pos, None, None, zlib.adler32, _FIELDS.unpack_from
    while True:
        buf, rel = r._buf, pos - r._base
        if rel < 0 or rel + _BLOCK > len(buf):
            got = len(r.at(pos, _BLOCK))
            if got < _BLOCK:
                _end_of_data(r, pos, start, got, name, prev)
                return None
            buf, rel = r._buf, pos - r._base
        # The exact byte sum from adler32 (its low half is 1 + sum mod 65521): one call
        # when every byte is ASCII (sum <= 512 * 127 < 65521), else one per 256-byte half.
        hdr = buf[rel : rel + _BLOCK]
        if hdr.isascii():
            total = (adler(hdr) & 0xFFFF) - 1
        else:
            total = (adler(hdr[:256]) & 0xFFFF) + (adler(hdr[256:]) & 0xFFFF) - 2
        if total == 0:
            if pos != start:
                raise _fault(r.url, pos, "end-of-archive block after a long-name or pax header")
            return None
        raw, num, chk, kind, prefixed = unpack(hdr)
        try:  # fast path for plain octal fields; _checked() applies tarfile's full rules
            size = int(num.rstrip(b"\0 "), 8)
            if int(chk.rstrip(b"\0 "), 8) != total - sum(chk) + 256 or size < 0:
                raise ValueError
        except ValueError:
            size = _checked(r, pos, hdr, total, name, prev)
        if kind in _EXTENSION:
            rel += _BLOCK
            ext = buf[rel : rel + size] if rel + size <= len(buf) else r.at(pos + _BLOCK, size)
            if len(ext) < size:
                raise _bad_header(r, pos, "truncated long-name or pax header", name, prev)
            if kind == b"L":
                if name is None:
                    name = _nts(ext)
            elif kind != b"K" and _PAX_KEYS.search(ext) is not None:
                name, size_override, start = _apply_pax(r, pos, kind, ext, size, name, size_override, start)
            elif kind == b"g" and pos == start:  # tarfile does not count a leading global header in
                start = pos + _BLOCK + ((size + 511) & ~511)
            pos += _BLOCK + ((size + 511) & ~511)
            continue
        if kind == b"S":
            raise _fault(r.url, pos, "sparse members are not supported", name=name)
        i = raw.find(0)
        raw = raw[: 100 if i < 0 else i].decode(_ENC, "surrogateescape")
        if name is None:
            name = raw if not prefixed else f"{_nts(hdr[345:500])}/{raw}"
        if size_override is not None:
            size = size_override
        data = pos + _BLOCK
        nxt = data if kind in _NO_PAYLOAD else data + ((size + 511) & ~511)
        if 0 <= r.eof < nxt:
            raise _cut(r, name, data, size, nxt)
        return start, data, size, nxt, name, kind in _REGULAR and not (kind == b"\0" and raw.endswith("/"))


def _apply_pax(r: _Reader, pos: int, kind: bytes, ext: bytes, size: int, name: str | None,
               size_override: int | None, start: int) -> tuple[str | None, int | None, int]:
    """Fold one pax header into the pending (name, size override, first header offset)."""
    try:
        pax = _pax(ext)
    except ValueError as exc:
        raise _fault(r.url, pos, f"invalid pax header ({exc})") from exc
    if any(k.startswith("GNU.sparse.") for k in pax):
        raise _fault(r.url, pos, "sparse members are not supported", name=name)
    if kind == b"g":
        if "path" in pax or "size" in pax:
            raise _fault(r.url, pos, "a global pax header overriding path or size is not supported")
        if pos == start:
            start = pos + _BLOCK + ((size + 511) & ~511)
        return name, size_override, start
    if name is None and "path" in pax:
        name = pax["path"].rstrip("/")
    if size_override is None and "size" in pax:
        try:
            size_override = int(pax["size"])
        except ValueError:
            size_override = 0  # what tarfile does with a malformed pax size
    return name, size_override, start


# Frozen dataclasses set each field through object.__setattr__, about half of the
# grouping cost per member; the parser has already checked its values, so it fills the
# slots directly (same objects, no __init__ / __post_init__).
_new = object.__new__
_m_name, _m_ext, _m_hdr, _m_data, _m_size = (getattr(Member, f).__set__ for f in Member.__dataclass_fields__)
_s_key, _s_off, _s_len, _s_members, _s_data = (getattr(ScannedSample, f).__set__ for f in ScannedSample.__dataclass_fields__)


def _member(name: str, ext: str, header_offset: int, data_offset: int, size: int) -> Member:
    m = _new(Member)
    _m_name(m, name), _m_ext(m, ext), _m_hdr(m, header_offset), _m_data(m, data_offset), _m_size(m, size)
    return m


def _sample(key: str, members: list[Member], data: dict[str, bytes]) -> ScannedSample:
    first, last = members[0].header_offset, members[-1]
    s = _new(ScannedSample)
    _s_key(s, key), _s_off(s, first), _s_members(s, tuple(members)), _s_data(s, data)
    _s_len(s, last.data_offset + ((last.size + 511) & ~511) - first)
    return s


def _samples(r: _Reader, want: frozenset[str], head: int | None, start: int = 0) -> Iterator[ScannedSample]:
    pos, prev = start, None
    key: str | None = None
    members: list[Member] = []
    data: dict[str, bytes] = {}
    exts: list[str] = []
    bad = False
    unpack, adler, enc = _FIELDS.unpack_from, zlib.adler32, _ENC
    fd, pread = r._fd, os.pread
    while True:
        # Fast path, inline: a plain ustar regular-file header already in the buffer
        # (what ShardWriter and most tools write). Anything else -- extension headers,
        # prefixes, non-ASCII, bad checksums, the end, truncation -- goes to _entry,
        # which applies every rule and raises with the offset.
        e = None
        buf, rel = r._buf, pos - r._base
        if rel < 0 or rel + _BLOCK > len(buf):
            if fd >= 0 and pos + _WINDOW <= r.eof:
                try:  # the common case inline: a full window well inside a local file
                    buf = r._buf = pread(fd, _WINDOW, pos)
                    r._base, rel = pos, 0
                except OSError:
                    buf = b""
            if rel != 0 or len(buf) < _WINDOW:
                r.at(pos, _BLOCK)  # short reads, errors and stream mode: the full rules
                buf, rel = r._buf, pos - r._base
        if rel >= 0 and rel + _BLOCK <= len(buf):
            raw, num, chk, kind, prefixed = unpack(buf, rel)
            if (kind == b"0" or kind == b"\0") and not prefixed:
                hdr = buf[rel : rel + _BLOCK]
                if hdr.isascii():
                    total = (adler(hdr) & 0xFFFF) - 1
                    try:
                        size = int(num.rstrip(b"\0 "), 8)
                        ok = total > 0 and size >= 0 and int(chk.rstrip(b"\0 "), 8) == total - sum(chk) + 256
                    except ValueError:
                        ok = False
                    if ok:
                        i = raw.find(0)
                        nm = (raw if i < 0 else raw[:i]).decode(enc, "surrogateescape")
                        data_at = pos + _BLOCK
                        nxt = data_at + ((size + 511) & ~511)
                        if not nm.endswith("/") and not 0 <= r.eof < nxt:
                            e = (pos, data_at, size, nxt, nm, True)
        if e is None:
            e = _entry(r, pos, prev)
            if e is None:
                break
        start, off, size, pos, name, regular = prev = e
        if not regular or (name.startswith("__") and _is_meta(name)):
            continue
        # webdataset's base_plus_ext without a regex: key = up to the first dot of the
        # file name (which needs at least one character before it), ext = the rest
        cut = name.rfind("/") + 1
        dot = name.find(".", cut)
        if dot <= cut or "\n" in name:
            m = _KEY_RE.match(name)  # no key, or a name the regex treats specially
            if m is None:
                continue
            k, ext = m.groups()
        else:
            k, ext = name[:dot], name[dot + 1 :]
        ext = ext.lower()
        if k != key:
            if key is not None and not bad:
                yield _sample(key, members, data)
            key, members, data, exts, bad = k, [], {}, [], False
        if ext in exts or ext in _RESERVED_EXTS:
            if r.eof < 0 and pos > off and not r.at(pos - 1, 1):  # stream mode: a cut payload, as seek mode sees first
                raise _cut(r, name, off, size, pos)
            raise _fault(r.url, start, f"duplicate suffix {ext!r} in one sample (webdataset rejects it)", name=name, key=k)
        exts.append(ext)
        members.append(_member(name, ext, start, off, size))
        if ext == "__bad__" and size:
            bad = True  # webdataset's valid_sample drops it
        if ext in want:
            n = size if head is None or head > size else head
            rel = off - r._base
            payload = r._buf[rel : rel + n] if rel >= 0 and rel + n <= len(r._buf) else r.at(off, n)
            if len(payload) < n:
                raise _cut(r, name, off, size, pos, len(payload))
            data[ext] = payload
    if key is not None and not bad:
        yield _sample(key, members, data)


def scan_tar(
    f: BinaryIO,
    url: str,
    *,
    want: Collection[str] = (),
    head_bytes: int | None = None,
    seekable: bool | None = None,
    on_error: str | OnError = "raise",
) -> Iterator[ScannedSample]:
    """Yield the webdataset samples of one tar shard with their byte ranges.

    Args:
        f: A binary file object (local file, fsspec file, streaming HTTP body) whose
            offset 0 (seek mode) or current position (stream mode) starts the archive.
        url: The shard's URL, for error messages.
        want: Extensions (webdataset suffixes such as ``"json"``) whose payloads go into
            ``ScannedSample.data``; others are skipped without reading when ``f`` seeks.
        head_bytes: Read only this many leading bytes of each wanted payload.
        seekable: Seek past payloads (True) or read through the file (False); ``None``
            asks ``f.seekable()``. Both modes yield identical samples.
        on_error: ``"raise"``: raise on the first fault. ``"skip"``: on a fault (corrupt,
            truncated or non-tar data, duplicate suffix) stop the shard there: the samples
            completed before the fault have been yielded, the sample in progress is
            dropped, a warning is logged, and the generator returns the
            :class:`TarFormatError` (``err = yield from scan_tar(...)``) so the caller can
            record the shard as skipped; it returns ``None`` after a clean scan.

    Yields:
        One :class:`ScannedSample` per sample, in archive order.

    Raises:
        TarFormatError: The shard is not a valid tar archive for webdataset (with
            ``on_error="raise"``); the message names the URL, byte offset and member.
        ShardError: Reading ``f`` failed.
        ConfigError: An argument is invalid.
    """
    wanted, head, mode = _options(want, head_bytes, on_error)
    return _scan(f, url, wanted, head, seekable, mode)


def _options(want: Collection[str], head_bytes: int | None,
             on_error: str | OnError) -> tuple[frozenset[str], int | None, OnError]:
    """Check scan_tar's arguments; return (wanted extensions, head_bytes, mode)."""
    try:
        mode = OnError(on_error)
    except ValueError as exc:
        raise ConfigError(f"on_error must be 'raise' or 'skip', got {on_error!r}") from exc
    if head_bytes is not None and (isinstance(head_bytes, bool) or not isinstance(head_bytes, int) or head_bytes < 0):
        raise ConfigError(f"head_bytes must be None or a non-negative int, got {head_bytes!r}")
    return frozenset(e.lower() for e in ((want,) if isinstance(want, str) else want)), head_bytes, mode


def _scan(f: BinaryIO, url: str, want: frozenset[str], head: int | None, seekable: bool | None,
          mode: OnError) -> Iterator[ScannedSample]:
    if seekable is None:
        seekable = bool(getattr(f, "seekable", lambda: False)())
    try:
        r = _Reader(f, url, seekable)
        yield from _samples(r, want, head)
    except TarFormatError as exc:
        if mode is OnError.RAISE:
            raise
        _log.warning("skipping the rest of shard: %s", exc)
        return exc
    return None


def parse_sample(data: bytes, url: str, offset: int, key: str | None = None) -> dict[str, bytes]:
    """Parse one sample's byte range, as recorded by ``scan_tar``, into ``{ext: payload}``.

    Args:
        data: The bytes ``[offset, offset + length)`` of the shard.
        url: The shard's URL, for error messages.
        offset: Where ``data`` starts in the shard, for error messages.
        key: The expected ``__key__``; ``None`` accepts any single key.

    Returns:
        Every member's payload keyed by its webdataset suffix.

    Raises:
        StaleShardError: The bytes are not that sample: a header is invalid, a payload
            runs past the range, the range holds another key or more than one, or a
            suffix repeats. The shard changed since it was indexed; re-index it.
    """
    if not isinstance(data, bytes):
        data = bytes(data)
    return _parse_range(_Reader(None, url, True, data), url, 0, len(data), offset, key)


class _Fd:
    """A file-like over a descriptor for :class:`_Reader` (reads use os.pread)."""

    __slots__ = ("fd",)

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def fileno(self) -> int:
        return self.fd


def parse_sample_at(fd: int, url: str, offset: int, length: int, key: str | None = None) -> dict[str, bytes]:
    """Like :func:`parse_sample`, reading the range ``[offset, offset + length)`` of a local file.

    Headers are read in small windows and each payload of 4 KiB or more with its own
    ``os.pread``, so a large member reaches the caller without being copied out of a
    larger buffer (at ~500 KB per sample that copy costs as much as the read).

    Raises:
        StaleShardError: as :func:`parse_sample` (also when the file is now shorter).
    """
    return _parse_range(_Reader(_Fd(fd), url, True), url, offset, offset + length, 0, key)  # type: ignore[arg-type]


def _parse_range(r: _Reader, url: str, start: int, end: int, base: int, key: str | None) -> dict[str, bytes]:
    """Members of the one sample in ``[start, end)`` of ``r``; ``base`` shifts offsets in messages."""
    out: dict[str, bytes] = {}
    pos, got, e = start, None, None
    try:
        while pos < end:
            e = _entry(r, pos, e)
            if e is None:
                raise ValueError(f"end-of-archive block at offset {base + pos}")
            _, off, size, pos, name, regular = e
            if pos > end:
                raise ValueError(f"member {name!r} runs past the end of the range")
            if not regular or (name.startswith("__") and _is_meta(name)):
                continue
            m = _KEY_RE.match(name)
            if m is None:
                continue
            k, ext = m.group(1), m.group(2).lower()
            if got is None:
                got = k
            if k != got or (key is not None and k != key) or ext in out:
                raise ValueError(f"member {name!r} does not belong to sample {key or got!r}")
            payload = r.at(off, size)
            if len(payload) < size:
                raise ValueError(f"member {name!r} is cut short")
            out[ext] = payload
        if pos != end or got is None:
            raise ValueError(f"range of {end - start} bytes does not end where its last member ends ({pos - start})")
    except (TarFormatError, ValueError) as exc:
        detail = str(exc).removesuffix(f"; {_HINT}").removeprefix(f"{url}: ")
        where = "offsets relative to the range" if base else "absolute offsets"
        raise StaleShardError(
            f"{url}: the {end - start} bytes at offset {base + start} are not sample {key!r} as indexed "
            f"({detail}; {where}); the shard changed since it was indexed, re-index it"
        ) from exc
    return out
