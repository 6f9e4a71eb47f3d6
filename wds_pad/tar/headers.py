"""Bytes of a tar shard, read entry by entry with ``tarfile``'s rules, and its fault messages.

The layer under both tar drivers (:mod:`.scan`, the general parser, and :mod:`.lean`,
the indexer's lean path): :class:`.reader.Reader` serves a shard's bytes at absolute
offsets, :func:`read_entry` reads the archive entry at an offset (its
extension headers folded in), and :func:`fault` / :func:`truncated` build every
:class:`TarFormatError` either driver raises. The header constants (``BLOCK``,
``FIELDS``, ``ENC``, ``HINT``, ...) are the package's vocabulary.

Invariants:
    * Header semantics follow ``tarfile``: ustar prefix, GNU ``L``/``K`` long names,
      pax ``x`` ``path``/``size`` overrides (outermost header wins), base-256 numbers,
      signed or unsigned checksums, the first zero block ends the archive, EOF exactly at
      a header boundary ends it too. Sparse members, compressed shards and global pax
      headers that override ``path`` or ``size`` are rejected: they have no faithful
      contiguous byte range.
    * An entry's first offset is its first header block (long-name and pax blocks
      included); its next offset is the 512-padded end of its payload.
    * ``Reader.at(off, n)`` is short only at end of file, in seek mode (``pread`` or
      ``seek``/``read``) and stream mode (forward reads in 1 MiB chunks) alike, so both
      modes read the same entries and raise the same faults at the same offsets.
    * Every fault names the URL, the byte offset and, when readable, the member (or the
      member before it), and ends with the same hint.
"""

from __future__ import annotations

import re
import struct
import sys
import zlib

from ..errors import TarFormatError
from .reader import Reader

BLOCK = 512
ENC = sys.getfilesystemencoding()  # what tarfile (and so webdataset) decodes names with
_PAX_RE = re.compile(rb"(\d+) ([^=]+)=")  # tarfile's pax record pattern
_PAX_KEYS = re.compile(rb"path=|size=|sparse")  # pax records that matter here (others: mtime, ...)
_REGULAR = frozenset((b"0", b"\0", b"7"))  # tarfile REGULAR_TYPES minus sparse "S"
_NO_PAYLOAD = frozenset((b"1", b"2", b"3", b"4", b"5", b"6"))  # links, devices, dirs, fifos
# name, size, chksum, typeflag, first byte of the ustar prefix
FIELDS = struct.Struct("100s24x12s12x8sc188xB")
_EXTENSION = frozenset((b"L", b"K", b"x", b"X", b"g"))  # headers that describe the next one
HINT = "re-create the shard, or index with on_error='skip' to keep the samples before the fault"
# what to do about a shard whose bytes are no longer what its index says ({url} filled
# in): a rewrite in place may keep the size and mtime that a plain --update compares
REINDEX = "re-index it: `wds-pad index --update -o INDEX --rescan {url}` (or restore the shard)"
_COMPRESSED = ((b"\x1f\x8b", "gzip"), (b"BZh", "bzip2"), (b"\xfd7zXZ", "xz"), (b"\x28\xb5\x2f\xfd", "zstd"))


def _nts(b: bytes) -> str:
    p = b.find(b"\0")
    return (b if p < 0 else b[:p]).decode(ENC, "surrogateescape")


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


def _int(b: bytes) -> int:
    """:func:`_num`, plain octal digits first (the common spelling, without its rules)."""
    try:
        return int(b.rstrip(b"\0 "), 8)
    except ValueError:
        return _num(b)


def _byte_sum(hdr: bytes) -> int:
    """The exact sum of a header's 512 bytes, from adler32 (its low half is 1 + sum mod
    65521): one call when every byte is ASCII (sum <= 512 * 127 < 65521), else one per
    256-byte half."""
    if hdr.isascii():
        return (zlib.adler32(hdr) & 0xFFFF) - 1
    return (zlib.adler32(hdr[:256]) & 0xFFFF) + (zlib.adler32(hdr[256:]) & 0xFFFF) - 2


def _checksum_ok(hdr: bytes, total: int) -> bool:
    """Check the header checksum; ``total`` is the exact sum of all 512 bytes."""
    stored = _num(hdr[148:156])
    unsigned = total - sum(hdr[148:156]) + 256
    if stored == unsigned:
        return True
    high = sum(1 for i, c in enumerate(hdr) if c >= 128 and not 148 <= i < 156)
    return stored == unsigned - 256 * high  # tarfile also accepts a signed-char sum


def _sum_ok(hdr: bytes) -> bool:
    """Whether a header's checksum is right, by tarfile's rules."""
    try:
        return _checksum_ok(hdr, _byte_sum(hdr))
    except ValueError:
        return False


def _not_a_tar(r: Reader, head: bytes, why: str) -> TarFormatError:
    for magic, comp in _COMPRESSED:
        if head.startswith(magic):
            return fault(r.url, 0, f"{comp}-compressed shard (byte ranges need an uncompressed tar)")
    return fault(r.url, 0, f"not a tar archive ({why})")


def _checked(r: Reader, pos: int, hdr: bytes, total: int, name: str | None, prev: Entry | None) -> int:
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
        out[m.group(2).decode("utf-8", "surrogateescape")] = value.decode(ENC, "surrogateescape")
        pos += length
    return out


def fault(url: str, offset: int, what: str, *, name: str | None = None, key: str | None = None,
           after: str | None = None) -> TarFormatError:
    where = "".join((f", member {name!r}" if name else "",
                     f", the header after member {after!r} (its own name is unreadable)" if after and not name else "",
                     f", sample key {key!r}" if key else ""))
    return TarFormatError(f"{url}: {what} at byte offset {offset}{where}; {HINT}")


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
    name = raw.decode(ENC, "surrogateescape")
    if len(hdr) >= 500 and hdr[345]:
        name = f"{_nts(hdr[345:500])}/{name}"
    return name if name.isprintable() else None


def _bad_header(r: Reader, pos: int, what: str, name: str | None, prev: Entry | None) -> TarFormatError:
    """A fault in the header at ``pos``: named after its member, or after the entry before."""
    return fault(r.url, pos, what, name=name, after=None if name or prev is None else prev[4])


def truncated(r: Reader, name: str | None, data: int, size: int, nxt: int, got: int = -1) -> TarFormatError:
    """The archive ends inside a member's payload (or its padding): the same message in
    seek and stream mode, at the offset where the file ends."""
    end = r.eof if r.eof >= 0 else data + max(got, 0)
    return fault(r.url, end, f"truncated inside the payload ({size} bytes at byte offset {data}, padded to "
                              f"{nxt}): the file ends", name=name)


# (header_offset, data_offset, size, next_header_offset, name, is_regular)
Entry = tuple[int, int, int, int, str, bool]


def _end_of_data(r: Reader, pos: int, start: int, got: int, name: str | None, prev: Entry | None) -> None:
    """Raise unless a short read at header ``pos`` is the clean end of the archive."""
    if pos == start and not got and pos == r.eof and pos:
        return  # EOF right at a header boundary ends the archive, as in tarfile
    if pos == 0:
        head = r.at(0, BLOCK)
        if not head:
            raise fault(r.url, 0, "empty file, not a tar archive")
        raise _not_a_tar(r, head, f"only {len(head)} bytes")
    if not got and 0 <= r.eof < pos:
        if prev is not None and prev[3] == pos:  # the entry before runs past the end
            raise truncated(r, prev[4], prev[1], prev[2], prev[3])
        raise fault(r.url, r.eof, f"truncated inside the payload of the member before offset {pos}")
    header = r.at(pos, got)
    raise _bad_header(r, pos, f"truncated tar header ({got} of {BLOCK} bytes)",
                      name if name is not None else _header_name(header), prev)


def read_entry(r: Reader, pos: int, prev: Entry | None) -> Entry | None:
    """Read the archive entry starting at ``pos``; ``None`` at the end of the archive.

    ``prev`` is the entry before it, if known (for messages)."""
    start, name, size_override, unpack = pos, None, None, FIELDS.unpack_from
    while True:
        buf, rel = r.buf, pos - r.base
        if rel < 0 or rel + BLOCK > len(buf):
            got = len(r.at(pos, BLOCK))
            if got < BLOCK:
                _end_of_data(r, pos, start, got, name, prev)
                return None
            buf, rel = r.buf, pos - r.base
        hdr = buf[rel : rel + BLOCK]
        total = _byte_sum(hdr)
        if total == 0:
            if pos != start:
                raise fault(r.url, pos, "end-of-archive block after a long-name or pax header")
            return None
        raw, num, chk, kind, prefixed = unpack(hdr)
        try:  # fast path for plain octal fields; _checked() applies tarfile's full rules
            size = int(num.rstrip(b"\0 "), 8)
            if int(chk.rstrip(b"\0 "), 8) != total - sum(chk) + 256 or size < 0:
                raise ValueError
        except ValueError:
            size = _checked(r, pos, hdr, total, name, prev)
        if kind in _EXTENSION:
            rel += BLOCK
            ext = buf[rel : rel + size] if rel + size <= len(buf) else r.at(pos + BLOCK, size)
            if len(ext) < size:
                raise _bad_header(r, pos, "truncated long-name or pax header", name, prev)
            if kind == b"L":
                if name is None:
                    name = _nts(ext)
            elif kind != b"K" and _PAX_KEYS.search(ext) is not None:
                name, size_override, start = _apply_pax(r, pos, kind, ext, size, name, size_override, start)
            elif kind == b"g" and pos == start:  # tarfile does not count a leading global header in
                start = pos + BLOCK + ((size + 511) & ~511)
            pos += BLOCK + ((size + 511) & ~511)
            continue
        if kind == b"S":
            raise fault(r.url, pos, "sparse members are not supported", name=name)
        i = raw.find(0)
        raw = raw[: 100 if i < 0 else i].decode(ENC, "surrogateescape")
        if name is None:
            name = raw if not prefixed else f"{_nts(hdr[345:500])}/{raw}"
        if size_override is not None:
            size = size_override
        data = pos + BLOCK
        nxt = data if kind in _NO_PAYLOAD else data + ((size + 511) & ~511)
        if 0 <= r.eof < nxt:
            raise truncated(r, name, data, size, nxt)
        return start, data, size, nxt, name, kind in _REGULAR and not (kind == b"\0" and raw.endswith("/"))


def member_name_size(data: bytes, first: int, h: int) -> tuple[str, int] | None:
    """The name and payload size of the regular member whose own header is at ``h`` in
    ``data`` (its first header at ``first``), as :func:`read_entry` reads them, for the
    common layouts only: no extension header before its own, or one PAX ``x`` or GNU
    ``L`` header. ``None`` for anything else (another type, more headers, a sparse
    record, an unreadable number, a bad checksum): :func:`read_entry` reads those (and
    says what is wrong)."""
    if first > h or h + BLOCK > len(data):
        return None
    raw, num, _, kind, prefixed = FIELDS.unpack_from(data, h)
    if kind not in _REGULAR or not _sum_ok(data[h : h + BLOCK]):
        return None
    if first != h and not _sum_ok(data[first : first + BLOCK]):
        return None
    name = None
    try:
        size = _int(num)
        if first != h:
            _, xnum, _, xkind, _ = FIELDS.unpack_from(data, first)
            n = _int(xnum)
            if n < 0 or first + BLOCK + ((n + 511) & ~511) != h or xkind not in (b"L", b"x"):
                return None
            ext = data[first + BLOCK : first + BLOCK + n]
            if xkind == b"L":
                name = _nts(ext)
            elif _PAX_KEYS.search(ext) is not None:
                if b"GNU.sparse." in ext:
                    return None  # sparse, or a record that names it: read_entry decides
                pax = _pax(ext)
                if "path" in pax:
                    name = pax["path"].rstrip("/")
                if "size" in pax:
                    size = _pax_size(pax["size"])
    except ValueError:
        return None
    i = raw.find(0)
    field = raw[: 100 if i < 0 else i].decode(ENC, "surrogateescape")
    if size < 0 or (kind == b"\0" and field.endswith("/")):
        return None
    if name is None:
        name = field if not prefixed else f"{_nts(data[h + 345 : h + 500])}/{field}"
    return name, size


def _apply_pax(r: Reader, pos: int, kind: bytes, ext: bytes, size: int, name: str | None,
               size_override: int | None, start: int) -> tuple[str | None, int | None, int]:
    """Fold one pax header into the pending (name, size override, first header offset)."""
    try:
        pax = _pax(ext)
    except ValueError as exc:
        raise fault(r.url, pos, f"invalid pax header ({exc})") from exc
    if any(k.startswith("GNU.sparse.") for k in pax):
        raise fault(r.url, pos, "sparse members are not supported", name=name)
    if kind == b"g":
        if "path" in pax or "size" in pax:
            raise fault(r.url, pos, "a global pax header overriding path or size is not supported")
        if pos == start:
            start = pos + BLOCK + ((size + 511) & ~511)
        return name, size_override, start
    if name is None and "path" in pax:
        name = pax["path"].rstrip("/")
    if size_override is None and "size" in pax:
        size_override = _pax_size(pax["size"])
    return name, size_override, start


def _pax_size(value: str) -> int:
    try:
        return int(value)
    except ValueError:
        return 0  # what tarfile does with a malformed pax size

