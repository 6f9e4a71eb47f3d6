"""Webdataset samples from tar entries: the per-member step both tar drivers share.

:func:`read_samples` walks a shard's entries from a sample's first header and groups them
into :class:`ScannedSample` records; :mod:`.scan` (``scan_tar``) yields them, and
:mod:`.lean` hands it a shard from the first sample its lean path does not take. Both
check their arguments with :func:`check_options`.

Invariants:
    * Grouping matches ``wds.WebDataset(url)`` exactly: only regular members count
      (``tarfile``'s ``isreg``); ``__*__`` metadata members and names without an
      extension are skipped; key and extension come from webdataset's
      ``base_plus_ext`` regex, the extension lowercased; consecutive members with the
      same key form a sample; a sample holding a non-empty ``__bad__`` member is dropped;
      a repeated extension within a sample is an error.
    * A key is the ``str`` webdataset gives (a name's bytes decoded as ``tarfile`` does:
      the filesystem encoding, each undecodable byte a surrogate escape such as
      ``'\\udcff'``); :func:`key_bytes` and :func:`key_text` turn it into the bytes an index
      stores and back, exactly, for every key a tar name can give.
    * A sample's range ``[offset, offset + length)`` starts at the first header block of
      its first member (long-name and pax blocks included) and ends at the 512-padded end
      of its last member's payload; it parses on its own with ``parse_sample``.
    * Seek mode and stream mode yield identical samples, and the inline fast path for
      plain ustar headers accepts only headers :func:`.headers.read_entry` reads the
      same way.
"""

from __future__ import annotations

import enum
import os
import re
import zlib
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field

from ..errors import ConfigError

from .headers import BLOCK, ENC, FIELDS, fault, read_entry, truncated
from .reader import WINDOW, Reader

KEY_RE = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")  # webdataset's base_plus_ext
_SKIP_META_RE = re.compile(r"__[^/]*__($|/)")  # webdataset's tar_file_iterator skip_meta
_RESERVED_EXTS = frozenset(("__key__", "__url__"))  # already in every webdataset sample
KEY_ERRORS = "surrogateescape"  # a key's undecodable name bytes, stored as those bytes


def key_bytes(key: str) -> bytes:
    """A key's bytes as an index stores them: UTF-8, each surrogate escape (a byte of the
    tar name that did not decode) as that byte again."""
    return key.encode("utf-8", KEY_ERRORS)


def key_text(raw: bytes | bytearray | memoryview) -> str:
    """The key of bytes :func:`key_bytes` gave: the same ``str`` webdataset reads."""
    return str(raw, "utf-8", KEY_ERRORS)


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
        if self.offset < 0 or self.offset % BLOCK or self.length < BLOCK or self.length % BLOCK:
            raise ConfigError(
                f"sample {self.key!r}: offset {self.offset} and length {self.length} must be "
                f"non-negative multiples of {BLOCK} (length at least one block)"
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
    m = KEY_RE.match(name)
    return None if m is None else (m.group(1), m.group(2))


def is_meta(name: str) -> bool:
    """Whether webdataset's tar_file_iterator skips the member as metadata."""
    if "/" not in name and name.endswith("__"):
        return True
    return _SKIP_META_RE.match(name) is not None



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


def read_samples(r: Reader, want: frozenset[str], head: int | None, start: int = 0) -> Iterator[ScannedSample]:
    """The per-member step: the samples of ``r`` from offset ``start`` (a sample's first
    header), each with the payloads of the ``want`` extensions (their first ``head``
    bytes when set); raises TarFormatError at the first fault, with its offset."""
    pos, prev = start, None
    key: str | None = None
    members: list[Member] = []
    data: dict[str, bytes] = {}
    exts: list[str] = []
    bad = False
    unpack, adler, enc = FIELDS.unpack_from, zlib.adler32, ENC
    fd, pread = r.fd, os.pread
    while True:
        # Fast path, inline: a plain ustar regular-file header already in the buffer
        # (what ShardWriter and most tools write). Anything else -- extension headers,
        # prefixes, non-ASCII, bad checksums, the end, truncation -- goes to read_entry,
        # which applies every rule and raises with the offset.
        e = None
        buf, rel = r.buf, pos - r.base
        if rel < 0 or rel + BLOCK > len(buf):
            if fd >= 0 and pos + WINDOW <= r.eof:
                try:  # the common case inline: a full window well inside a local file
                    buf = r.buf = pread(fd, WINDOW, pos)
                    r.base, rel = pos, 0
                except OSError:
                    buf = b""
            if rel != 0 or len(buf) < WINDOW:
                r.at(pos, BLOCK)  # short reads, errors and stream mode: the full rules
                buf, rel = r.buf, pos - r.base
        if rel >= 0 and rel + BLOCK <= len(buf):
            raw, num, chk, kind, prefixed = unpack(buf, rel)
            if (kind == b"0" or kind == b"\0") and not prefixed:
                hdr = buf[rel : rel + BLOCK]
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
                        data_at = pos + BLOCK
                        nxt = data_at + ((size + 511) & ~511)
                        if not nm.endswith("/") and not 0 <= r.eof < nxt:
                            e = (pos, data_at, size, nxt, nm, True)
        if e is None:
            e = read_entry(r, pos, prev)
            if e is None:
                break
        start, off, size, pos, name, regular = prev = e
        if not regular or (name.startswith("__") and is_meta(name)):
            continue
        # webdataset's base_plus_ext without a regex: key = up to the first dot of the
        # file name (which needs at least one character before it), ext = the rest
        cut = name.rfind("/") + 1
        dot = name.find(".", cut)
        if dot <= cut or "\n" in name:
            m = KEY_RE.match(name)  # no key, or a name the regex treats specially
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
                raise truncated(r, name, off, size, pos)
            raise fault(r.url, start, f"duplicate suffix {ext!r} in one sample (webdataset rejects it)", name=name, key=k)
        exts.append(ext)
        members.append(_member(name, ext, start, off, size))
        if ext == "__bad__" and size:
            bad = True  # webdataset's valid_sample drops it
        if ext in want:
            n = size if head is None or head > size else head
            rel = off - r.base
            payload = r.buf[rel : rel + n] if rel >= 0 and rel + n <= len(r.buf) else r.at(off, n)
            if len(payload) < n:
                raise truncated(r, name, off, size, pos, len(payload))
            data[ext] = payload
    if key is not None and not bad:
        yield _sample(key, members, data)


def check_options(want: Collection[str], head_bytes: int | None,
             on_error: str | OnError) -> tuple[frozenset[str], int | None, OnError]:
    """Check scan_tar's (and scan_rows') arguments; return (wanted extensions, head_bytes, mode)."""
    try:
        mode = OnError(on_error)
    except ValueError as exc:
        raise ConfigError(f"on_error must be 'raise' or 'skip', got {on_error!r}") from exc
    if head_bytes is not None and (isinstance(head_bytes, bool) or not isinstance(head_bytes, int) or head_bytes < 0):
        raise ConfigError(f"head_bytes must be None or a non-negative int, got {head_bytes!r}")
    return frozenset(e.lower() for e in ((want,) if isinstance(want, str) else want)), head_bytes, mode

