"""Does a member's header still say what the member table records? The fast path's check.

Streaming reads a sample's payloads straight from the offsets its index's member table
records (``stream.batchread``, ``stream.fetch``), without parsing the headers; before it
trusts them, it checks each member's header against the table: the member is named
``key + "." + ext`` and holds ``size`` bytes. The common header form is checked with
two ``bytes.startswith`` at offsets, against tokens made in numpy once per chunk of
samples (:func:`name_tokens`, :func:`size_tokens`); the other forms the usual writers
write, as bytes too; every other form, and every mismatch, is decided by
:func:`member_differs`, which reads the member's headers as the indexer reads them.
:func:`slice_sample` and :func:`slice_sample_at` cut one sample into ``{ext: payload}``
that way, and raise :class:`StaleShardError` naming what changed.

Invariants:
    * The common form (``tarfile``, GNU ``tar``, webdataset's writers, for a name that
      fits the ustar name field): the 512-byte ustar header right before the payload has
      the name field ``key + "." + ext`` (the extension as recorded: lowercase) padded
      with NUL, and the size field ``%011o`` then NUL. An extension header before it
      (webdataset's PAX ``mtime`` header, ``tar --format=posix``'s times) is not read.
    * A name the tokens do not cover, in a form the usual writers write, is compared as
      bytes (:func:`_spelled_as_written`): the name field with the extension in another
      case, a ustar prefix and name; a name the name field cannot hold (over 99 bytes,
      or not ASCII under PAX) as ``tarfile``, webdataset's writers and GNU tar write it:
      one PAX header of its ``path`` record (and at most one record that changes
      nothing) or a GNU long name, then the ustar header with the name's first 100 bytes;
      the size field in every case.
    * Any other form is read from the member's first header (the end of the member
      before it, or the sample's first byte) with the indexer's rules, checksums
      included (``headers.member_name_size``, else ``headers.read_entry``): a PAX
      ``size`` record (members of 8 GiB or more), another writer's long-name layout,
      another spelling of the size field, a changed header. Its verdict is final.
    * A member whose headers say another key, another extension, another size or
      another payload offset, or cannot be read, is never read as the sample: the reason
      names it, and :func:`slice_sample` raises ``StaleShardError``.
    * What the checks as bytes do not see: checksums and the headers' other fields (mode,
      mtime, ...), a PAX record that changes nothing; no form's check sees payload bytes.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from ..errors import StaleShardError, TarFormatError
from .headers import ENC, HINT, REINDEX, member_name_size, read_entry
from .reader import Reader
from .members import KEY_ERRORS, KEY_RE, is_meta, key_bytes
from .settle import PAX_MATTERS

__all__ = ["HEAD", "NAME", "SIZE", "Members", "key_list", "member_differs", "member_entry", "name_token_rows", "name_tokens",
           "size_token_rows", "size_tokens", "slice_sample", "slice_sample_at", "token_list"]

NAME = 100  # bytes of a ustar header's name field
SIZE = 124  # where its size field starts
HEAD = SIZE + 12  # its name field up to the end of its size field: what a member check reads
_BINARY = b"21 hdrcharset=BINARY\n"  # tarfile's first pax record for a name that is not UTF-8

#: A sample's member table entry, as the fast path carries it: per member its extension,
#: header offset in the sample, payload size, name token and size token.
Members = tuple[list[str], list[int], list[int], list["bytes | tuple[()]"], list[bytes]]


def name_tokens(keys: np.ndarray, start: np.ndarray, end: np.ndarray, counts: np.ndarray, ext_ids: np.ndarray,
                exts: Sequence[str]) -> list[bytes | tuple[()]]:
    """Each member's name field as the common form holds it, made in numpy: its key's
    bytes, a dot and its extension, padded with NUL to the longest of them (at most the
    field's 100 bytes); ``()`` (a ``startswith`` argument that never matches) where the
    name and its NUL do not fit the field, so the member is read in full.

    Args: as :func:`name_token_rows`.
    """
    rows, fits = name_token_rows(keys, start, end, counts, ext_ids, exts)
    return token_list(rows, fits)


def token_list(rows: np.ndarray, fits: np.ndarray) -> list[bytes | tuple[()]]:
    """:func:`name_token_rows` as ``bytes`` tokens (``()`` where a name does not fit)."""
    if not rows.shape[0]:
        return []
    if not fits.any():
        return [()] * rows.shape[0]
    width = rows.shape[1]
    tokens: list[bytes | tuple[()]] = np.ascontiguousarray(rows).view(f"V{width}").ravel().tolist()
    for i in np.flatnonzero(~fits).tolist():
        tokens[i] = ()
    return tokens


def name_token_rows(keys: np.ndarray, start: np.ndarray, end: np.ndarray, counts: np.ndarray,
                    ext_ids: np.ndarray, exts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """The tokens of :func:`name_tokens` as one uint8 row per member (what a batch read
    into one buffer checks in numpy), and per member whether its name fits the field
    (a row that does not fit never counts as a match).

    Args:
        keys: Key bytes (uint8); sample ``i``'s key is ``keys[start[i]:end[i]]``.
        start, end: Per sample, its key's bounds in ``keys``.
        counts: Per sample, its members (their tokens come in this order).
        ext_ids: Per member, its extension's place in ``exts``.
        exts: The extension table.
    """
    nm = len(ext_ids)
    if not nm:
        return np.zeros((0, 0), np.uint8), np.zeros(0, bool)
    start, counts = np.asarray(start, np.int64), np.asarray(counts, np.int64)
    klen, ext_ids = np.asarray(end, np.int64) - start, np.asarray(ext_ids, np.intp)
    raw = [e.encode("utf-8", "surrogateescape") for e in exts]
    wide = max(map(len, raw)) + 1
    table = np.zeros((len(raw), wide), np.uint8)  # each extension, NUL-padded
    for i, e in enumerate(raw):
        table[i, : len(e)] = np.frombuffer(e, np.uint8)
    shortest, longest = int(klen.min()), int(klen.max())
    mlen = klen.repeat(counts)
    no_room: list[int] = []
    if longest + wide >= NAME:  # some name may leave no room for its NUL
        elen = np.fromiter(map(len, raw), np.int64, len(raw))
        no_room = np.flatnonzero(mlen + 1 + elen[ext_ids] >= NAME).tolist()
        if len(no_room) == nm:
            return np.zeros((nm, 0), np.uint8), np.zeros(nm, bool)
    key_rows = np.zeros((len(start), longest), np.uint8)  # each sample's key, NUL-padded
    if longest:
        fits = start <= len(keys) - longest  # a full window from there: one row copy each
        window = sliding_window_view(keys, longest)
        if fits.all():
            key_rows = window[start]
        else:
            cols = np.arange(longest)
            key_rows[fits] = window[start[fits]]
            tail = ~fits  # the last keys of the table, byte by byte
            key_rows[tail] = keys[np.minimum(start[tail, None] + cols, len(keys) - 1)]
        if shortest < longest:
            key_rows[np.arange(longest) >= klen[:, None]] = 0
    out = np.zeros((nm, longest + 1 + wide), np.uint8)
    out[:, :longest] = key_rows.repeat(counts, axis=0)
    for n in [longest] if shortest == longest else np.unique(klen).tolist():
        rows = slice(None) if shortest == longest else mlen == n  # one pass per key length
        out[rows, n] = 46  # "."
        out[rows, n + 1 : n + 1 + wide] = table[ext_ids[rows]]
    width = min(out.shape[1], NAME)
    fits = np.ones(nm, bool)
    fits[no_room] = False
    return np.ascontiguousarray(out[:, :width]), fits


def size_tokens(sizes: np.ndarray) -> list[bytes]:
    """Each payload size as the common form's size field holds it: eleven octal digits
    and NUL (a size of 8 GiB or more has no such spelling: its token never matches)."""
    return size_token_rows(sizes).view("V12").ravel().tolist()  # type: ignore[no-any-return]


def size_token_rows(sizes: np.ndarray) -> np.ndarray:
    """The tokens of :func:`size_tokens` as one uint8 row of 12 per member."""
    s = np.array(sizes, np.int64)
    out = np.full((s.size, 12), 48, np.uint8)
    big = s >= 8**11
    for j in range(10, -1, -1):  # one digit a pass, over uint8 columns: cheaper than a 2-D shift
        out[:, j] += (s & 7).astype(np.uint8)
        s >>= 3
    out[:, 11] = np.where(big, 48, 0)
    return out


def member_differs(data: bytes, first: int, h: int, key: str, ext: str, size: int, where: str = "") -> str:
    """What the headers of one member say that its member table entry does not ("" when
    they agree), read with the indexer's rules: ``headers.member_name_size`` for the
    common layouts (its own header, after at most one PAX or GNU long-name header), else
    ``headers.read_entry`` from its first header.

    Args:
        data: Bytes holding the member's headers (a sample's bytes, or a part of them:
            its payload need not be there).
        first: Where its first header starts in ``data`` (the end of the member before
            it, or the sample's first byte; ``h`` when none comes before its own).
        h: Where its own (ustar) header starts: its payload starts at ``h + 512``.
        key, ext, size: The sample's key, the member's extension and payload size.
        where: What ``data``'s offsets count from, for the message.
    """
    got = member_name_size(data, first, h)
    if got is None:
        r, pos, e = Reader(None, where, True, data), first, None
        r.eof = -1  # ``data`` may end before the member's payload does
        try:
            while pos <= h:
                e = read_entry(r, pos, e)
                if e is None:
                    return f"the archive ends before the header of its {ext!r} member"
                if e[1] == h + 512:
                    break
                pos = e[3]
            else:
                return f"no member header ends where its {ext!r} payload starts"
        except TarFormatError as exc:
            detail = str(exc).removesuffix(f"; {HINT}").removeprefix(f"{where}: ")
            return f"the headers of its {ext!r} member are unreadable ({detail}; {where})"
        name, n, regular = e[4], e[2], e[5]  # type: ignore[index]
        if not regular:
            return f"the header before its {ext!r} payload is not a regular file's (member {name!r})"
        got = (name, n)
    name, n = got
    if n == size and name == f"{key}.{ext}":  # the form only differed (a long name, a PAX path, ...)
        return ""
    m = None if is_meta(name) else KEY_RE.match(name)
    if m is None or m.group(1) != key:
        return f"the header before its {ext!r} payload names member {name!r}, not one of sample {key!r}"
    if m.group(2).lower() != ext:
        return f"member {key + '.' + ext!r} is now named {name!r}"
    if n != size:
        return f"member {name!r} now holds {n} bytes, {size} indexed"
    return ""


def _spelled_as_written(data: bytes, first: int, h: int, key: str, ext: str) -> bool:
    """Whether the member's headers name it ``key + "." + ext``, byte for byte, in a form
    the usual writers write and the tokens do not cover: its own header alone, of a
    regular file, with the extension in another case or the name split into a ustar
    prefix; or, for a name its header's name field cannot hold, as ``tarfile`` (so
    webdataset's writers) or GNU tar write it: one PAX header whose records are the
    name's ``path`` (after ``hdrcharset=BINARY`` for a name that is not UTF-8; at most one
    record that changes nothing after it, such as ``wds.TarWriter``'s ``mtime``), or a GNU
    long name, then the member's own header holding the name's first 100 bytes (as ASCII
    with ``?`` under PAX, raw under GNU). The caller has checked the size field.
    Checksums are not read, as for the common form. False: anything else, read in full."""
    if h + 512 > len(data) or ENC != "utf-8":
        return False
    if first == h:  # its own header alone: what read_entry reads as its name
        kind, raw = data[h + 156], key_bytes(key) + b"."
        field = data[h : h + NAME].split(b"\0", 1)[0]
        if data[h + 345]:
            field = data[h + 345 : h + 500].split(b"\0", 1)[0] + b"/" + field
        return (kind == 48 or (kind == 0 and not field.endswith(b"/"))) and field.startswith(raw) \
            and field[len(raw) :].lower() == ext.encode("utf-8", "surrogateescape")
    if first > h or data[h + 156] != 48:  # "0": a regular file
        return False
    try:
        n = int(data[first + SIZE : first + SIZE + 12].rstrip(b"\0 "), 8)
    except ValueError:
        return False
    if first + 512 + ((n + 511) & ~511) != h:
        return False
    name = f"{key}.{ext}"
    raw, kind = key_bytes(name), data[first + 156]
    if kind == 76:  # "L"
        return n == len(raw) + 1 and data.startswith(raw, first + 512) and data[first + 512 + len(raw)] == 0 \
            and _field_holds(data, h, raw)
    if kind != 120 or not _field_holds(data, h, name.encode("ascii", "replace")):  # "x"
        return False
    body = b" path=" + raw + b"\n"
    digits = len(str(len(body)))
    record = b"%d" % (len(body) + digits + (len(str(len(body) + digits)) > digits)) + body  # its length counts itself
    payload = data[first + 512 : first + 512 + n]
    for head in (record, _BINARY + record):
        if payload.startswith(head):
            rest = payload[len(head) :]
            if not rest:
                return True
            count = rest.split(b" ", 1)[0]  # one more record, as long as it says, that changes nothing
            return count.isdigit() and int(count) == len(rest) and rest.endswith(b"\n") and \
                rest.count(b"\n") == 1 and b"=" in rest and PAX_MATTERS.search(rest) is None
    return False


def _field_holds(data: bytes, h: int, name: bytes) -> bool:
    """Whether the name field at ``h`` holds ``name``'s first 100 bytes (NUL-padded)."""
    return data.startswith(name[:NAME], h) and (len(name) >= NAME or data[h + len(name)] == 0)


def _stale(url: str, offset: int, key: str, reason: str) -> StaleShardError:
    return StaleShardError(f"{url}: sample {key!r} at byte offset {offset} is not as indexed: {reason}; "
                           "the shard changed since it was indexed, " + REINDEX.format(url=url))


def slice_sample(data: bytes, url: str, offset: int, key: str, members: Members) -> dict[str, bytes]:
    """``{ext: payload}`` of one sample's bytes through its member table entry.

    Args:
        data: The sample's byte range ``[offset, offset + length)``.
        url, offset: The shard and the range's offset, for messages.
        key: The sample's ``__key__``.
        members: Its member table entry (:data:`Members`).

    Raises:
        StaleShardError: A member's headers say another name, extension, size or payload
            offset, or its payload runs past the range.
    """
    exts, heads, sizes, ntoks, stoks = members
    out, first = {}, 0
    for e, h, n, nt, st in zip(exts, heads, sizes, ntoks, stoks):
        if not (data.startswith(st, h + SIZE)
                and (data.startswith(nt, h) or _spelled_as_written(data, first, h, key, e))):
            reason = member_differs(data, first, h, key, e, n, "offsets from the sample's first byte")
            if reason:
                raise _stale(url, offset, key, reason)
        if h + 512 + n > len(data):
            raise _stale(url, offset, key, f"its {e!r} payload runs past the sample's {len(data)} bytes")
        out[e] = data[h + 512 : h + 512 + n]
        first = h + 512 + ((n + 511) & ~511)
    return out


def slice_sample_at(fd: int, url: str, offset: int, key: str, members: Members,
                    pread: Callable[[int, int, int], bytes] = os.pread) -> dict[str, bytes]:
    """:func:`slice_sample` reading a local file: each header, and each payload, its own
    ``pread`` (a large payload reaches the caller without being copied out of a buffer).

    Raises:
        StaleShardError: as :func:`slice_sample` (also when the file is now shorter).
    """
    exts, heads, sizes, ntoks, stoks = members
    out, first = {}, 0
    for e, h, n, nt, st in zip(exts, heads, sizes, ntoks, stoks):
        head = pread(fd, 512, offset + h)
        if not (head.startswith(nt) and head.startswith(st, SIZE)):
            region = pread(fd, h + 512 - first, offset + first)  # its headers, from its first
            if not (head.startswith(st, SIZE) and _spelled_as_written(region, 0, h - first, key, e)):
                reason = member_differs(region, 0, h - first, key, e, n, f"offsets from byte {offset + first}")
                if reason:
                    raise _stale(url, offset, key, reason)
        payload = pread(fd, n, offset + h + 512)
        if len(payload) != n:
            raise _stale(url, offset, key, f"its {e!r} payload is cut short: {len(payload)} of {n} bytes")
        out[e] = payload
        first = h + 512 + ((n + 511) & ~511)
    return out


def member_entry(key: str, exts: Sequence[str], heads: Sequence[int], sizes: Sequence[int]) -> Members:
    """One sample's :data:`Members` from its key and its members' extensions, header
    offsets in the sample and payload sizes (the fast path makes them for a chunk of
    samples at once, ``stream.batchread``)."""
    raw = np.frombuffer(key_bytes(key), np.uint8)
    table = list(dict.fromkeys(exts))
    ids = np.asarray([table.index(e) for e in exts], np.intp)
    return (list(exts), list(heads), list(sizes),
            name_tokens(raw, np.zeros(1, np.int64), np.full(1, raw.size), np.full(1, len(exts)), ids, table),
            size_tokens(np.asarray(sizes, np.int64)))


def key_list(a: np.ndarray, b: np.ndarray, table: np.ndarray) -> list[str]:
    """The ``__key__`` of each sample whose key is ``table[a:b]``, in one numpy pass (decoded
    as ``Index.key`` decodes, ``tar.members.key_text``)."""
    lens = b - a
    end = np.cumsum(lens + 1)  # each key, then NUL
    out = np.zeros(int(end[-1]), np.uint8)
    total = int(lens.sum())
    if total:
        src = np.repeat(a - (np.cumsum(lens) - lens), lens) + np.arange(total, dtype=np.int64)
        dst = np.repeat(end - lens - 1 - (np.cumsum(lens) - lens), lens) + np.arange(total, dtype=np.int64)
        out[dst] = table[src]
    return out.tobytes().decode("utf-8", KEY_ERRORS).split("\0")[:-1]
