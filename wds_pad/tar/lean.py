"""Columnar tar scanning for the indexer: a lean loop per shard, header checks in numpy.

:func:`scan_rows` finds the same samples as :func:`wds_pad.index.tarscan.scan_tar`, but as
columns (offsets, lengths, keys, extension masks) rather than one object per sample,
which is what an index needs; :func:`scan_many` does it for a group of shards.

How: in seek mode the loop reads a header, parses only its size field, keeps the 512
bytes and jumps to the next header; in stream mode the run of headers in each 8 MiB
buffer is found with array operations. Every few thousand headers (in stream mode:
before the buffer moves on; for small shards: the last headers of up to 64 shards
together) :func:`.tarcols._settle_many` checks the kept headers at once in numpy and
turns them into rows. This loop stays inline, not a call per member into the shared
per-member step (:func:`.tarread._samples`): it does no per-member check at all.

A pax extended header (typeflag ``x``) before a member, as ``wds.TarWriter`` and ``tar
--format=posix`` write one before every member, is read too when its records cannot
change how the member is read (``mtime``, ``atime``, ``uname``, ... -- no ``path``,
``linkpath``, ``size``, ``hdrcharset`` or sparse record, see ``_PAX_MATTERS``): the loop
checks its payload and folds it into the member after it, whose first byte (``S``, the
sample's offset when it starts one) is then the pax header's; the pax header itself is
checked with the member's (``X``, ``XI``: the pax headers and their members' rows).

Anything else -- other extension headers (GNU long name, global pax, a pax header with a
record that matters, two in a row), a link or directory, a metadata or ``__bad__``
member, a repeated suffix, a bad checksum, truncation -- hands the rest of the shard,
from the start of the sample it occurs in, to the general parser's per-member step
(:func:`.tarread._samples`), which applies every rule and raises the precise error.

Invariants:
    * The same samples, byte ranges, errors and offsets as ``scan_tar``, in seek and
      stream mode: the lean path only ever accepts headers the general one reads the
      same way, and hands over at the start of a sample, never inside one.
    * Shards keep their order in :func:`scan_many`, for the samples and for the first
      error.
    * In seek mode the lean path takes over again after each sample the general parser
      reads, until it has handed back soon after taking over ``_REENTER`` times in a row.
"""

from __future__ import annotations

import os
import re
from array import array
from bisect import bisect_left
from dataclasses import dataclass
from typing import Any, BinaryIO, Callable, Collection, Sequence

import numpy as np

from ..errors import ShardError, TarFormatError
from .columns import _POW8_11, ScanRows, _Acc, _Segment, _settle, _settle_many
from .headers import _Reader
from .members import OnError, _options, _samples

__all__ = ["ScanRows", "scan_many", "scan_rows"]

_WINDOW = 4096  # seek mode: a header, a small payload (.json) and often the next header (and its pax header)
_CHUNK = 8 << 20  # stream mode: read size
_PROBE = 1 << 20  # stream mode: the first read
_SPAN = 32 << 10  # stream mode: members further apart on average -> the general parser
_BATCH = 4096  # seek mode: headers per numpy check
_MAX_WAITING = 64  # scan_many: shards (open files) waiting to be checked together
_MAX_HELD = 64 << 20  # stream mode: longer samples go to the general parser
_REENTER = 4  # seek mode: the lean path stops taking over from the general parser after
_LEAN_RUN = 16  # this many turns in a row that each added fewer than this many samples
_ZERO_BLOCK = bytes(512)
_PAX = 120  # typeflag "x": a pax extended header for the next member
_PAX_MAX = 4096  # longer pax payloads go to the general parser
# The records a pax header can change a regular member with, for the general parser (its
# tarentry._PAX_KEYS: path, linkpath, size, GNU.sparse.*) and for tarfile (those and
# hdrcharset): a payload holding none of these bytes, anywhere, is ignored by both (mtime,
# atime, ctime, uid, gid, uname, gname, comment, SCHILY.* ...), so the member after it
# reads as if alone; any other goes to the general parser.
_PAX_MATTERS = re.compile(rb"path=|size=|sparse|hdrcharset")
_STAR = np.frombuffer(b"star", np.uint32)[0]


def scan_rows(
    f: BinaryIO,
    url: str,
    *,
    want: Collection[str] = (),
    head_bytes: int | None = None,
    seekable: bool | None = None,
    on_error: str | OnError = "raise",
) -> ScanRows:
    """Scan one tar shard into columns; same samples, arguments and errors as ``scan_tar``.

    Args:
        f: A binary file object; a local file (with ``fileno()``) in seek mode takes the
            fastest path.
        url: The shard's URL, for error messages.
        want: Extensions whose payloads go into ``ScanRows.data``.
        head_bytes: Read only this many leading bytes of each wanted payload.
        seekable: Seek past payloads (True) or read through the file (False); ``None``
            asks ``f.seekable()``.
        on_error: ``"raise"``, or ``"skip"``: keep the samples before a fault and report
            it in ``ScanRows.fault``.

    Returns:
        The shard's samples in archive order.

    Raises:
        TarFormatError: The shard is not a valid tar archive for webdataset (with
            ``on_error="raise"``); the message names the URL, byte offset and member.
        ShardError: Reading ``f`` failed, or the shard's members have more than 64
            distinct extensions (the message names the shard and them).
        ConfigError: An argument is invalid.
    """
    return scan_many([(f, url)], want=want, head_bytes=head_bytes, seekable=seekable, on_error=on_error)[0]


def scan_many(
    sources: Sequence[tuple[BinaryIO, str] | tuple[BinaryIO, str, bool | None]],
    *,
    want: Collection[str] = (),
    head_bytes: int | None = None,
    seekable: bool | None = None,
    on_error: str | OnError = "raise",
    progress: Callable[[int], None] | None = None,
) -> list[ScanRows]:
    """:func:`scan_rows` for several shards, checking the headers of small local shards
    together (numpy's fixed cost per operation, about 0.1 ms a shard, is then shared).

    Args:
        sources: ``(file, url)`` pairs, open until this returns; a third item,
            ``seekable``, overrides the argument for that source.
        want, head_bytes, seekable, on_error: As for :func:`scan_rows`.
        progress: Called with counts of samples found as the scan goes (their sum is
            the samples returned), for a progress bar.

    Returns:
        One :class:`ScanRows` per source, in order.

    Raises:
        As :func:`scan_rows`, for the first shard that fails.
    """
    wanted, head, mode = _options(want, head_bytes, on_error)
    out: list[ScanRows | None] = [None] * len(sources)
    waiting: list[tuple[int, _Reader, _Acc, _Open]] = []

    def finish(i: int, r: _Reader, acc: _Acc, start: int) -> None:
        fault = None
        try:
            # -1: the lean path read the archive to its end. Otherwise the general parser
            # reads on; in seek mode the lean path takes over again after one sample (an
            # odd member -- a directory entry first, one long name -- is usually alone),
            # until it has handed back soon after taking over a few times in a row
            short = 0 if r._seek and r._fd >= 0 else _REENTER
            while start >= 0:
                samples = _samples(r, wanted, head, start)
                if short >= _REENTER:
                    for s in samples:
                        acc.add(s)
                    break
                s = next(samples, None)
                samples.close()
                if s is None:
                    break
                acc.add(s)
                before = acc.samples
                start = _settled(_lean_seek(r, acc, head, s.offset + s.length), acc, head)
                short = 0 if acc.samples - before >= _LEAN_RUN else short + 1
        except TarFormatError as exc:
            if mode is OnError.RAISE:
                raise
            fault = exc
        out[i] = acc.rows(r.url, fault)

    def check_waiting() -> None:
        segs = [_Segment(acc, len(o.P), o.payload, o.end) for _, _, acc, o in waiting]
        H = waiting[0][3].H if len(waiting) == 1 else bytearray().join(o.H for *_, o in waiting)
        P, S, X, XI = array("q"), array("q"), bytearray(), array("q")
        for *_, o in waiting:
            XI.extend([i + len(P) for i in o.XI])
            P.extend(o.P)
            S.extend(o.S)
            X += o.X
        _settle_many(segs, H, P, head, S, X, XI)
        for (i, r, acc, o), seg in zip(waiting, segs):
            finish(i, r, acc, o.settled(seg))
        waiting.clear()

    for i, (f, url, *mode_of) in enumerate(sources):
        seek = mode_of[0] if mode_of else seekable
        if seek is None:
            seek = bool(getattr(f, "seekable", lambda: False)())
        acc = _Acc(wanted, report=progress, url=url)
        try:
            r = _Reader(f, url, seek)
            if seek and r._fd >= 0:
                start: int | _Open = _lean_seek(r, acc, head)
            elif not seek:
                start = _lean_stream(r, acc, head)
            else:
                start = 0
        except TarFormatError as exc:
            if mode is OnError.RAISE:
                raise
            out[i] = acc.rows(url, exc)
            continue
        if isinstance(start, _Open):
            waiting.append((i, r, acc, start))
            if len(waiting) >= _MAX_WAITING or sum(len(o.P) for *_, o in waiting) >= _BATCH:
                check_waiting()
        else:
            if waiting:  # keep shard order, for the first error and for the samples
                check_waiting()
            finish(i, r, acc, start)
    if waiting:
        check_waiting()
    return out  # type: ignore[return-value]


def _settled(start: int | _Open, acc: _Acc, head: int | None) -> int:
    """Check a shard's waiting headers now; return where the general parser takes over."""
    if not isinstance(start, _Open):
        return start
    seg = _Segment(acc, len(start.P), start.payload, start.end)
    _settle_many([seg], start.H, start.P, head, start.S, start.X, start.XI)
    return start.settled(seg)


def _lean_seek(r: _Reader, acc: _Acc, head: int | None, pos: int = 0) -> int | _Open:
    """Seek mode over a local file, from ``pos`` (a sample's first header): return where
    the general parser takes over (-1: nowhere), or the last headers, still to be
    checked."""
    fd, eof, pread = r._fd, r.eof, os.pread
    H = bytearray()  # the headers, back to back
    P = array("q")  # header offsets
    S = array("q")  # each member's first byte: its pax header's, or its header's
    X, XI = bytearray(), array("q")  # pax headers folded in, and their members' rows
    W: list[bytes | None] = []  # each small payload read with its header (to be picked from)
    base = pos
    pax = -1  # the offset of a pax header read for the next member

    def read(i: int, n: int) -> bytes:
        try:
            got = pread(fd, n, P[i] + 512)
        except OSError as exc:
            raise ShardError(f"{r.url}: reading at byte offset {P[i] + 512} failed: {exc}") from exc
        if len(got) < n:
            raise ShardError(f"{r.url}: the file shrank while it was being scanned (payload at byte "
                             f"offset {P[i] + 512}); index it again once it is complete")
        return got

    def payload(members: list[int], sizes: list[int]) -> list[bytes]:
        return [read(i, n) if (w := W[i]) is None else w[:n] for i, n in zip(members, sizes)]

    # the loop runs once per tar member: locals only, the batch check only on a new window
    add_h, add_p, add_s, add_w = H.extend, P.append, S.append, W.append
    keep = bool(acc.want)  # then small payloads are kept as they pass (a .json, a .cls)
    batch, preadv = _BATCH, os.preadv
    search, add_x, add_xi = _PAX_MATTERS.search, X.extend, XI.append
    buf = bytearray(_WINDOW)
    view = memoryview(buf)
    windows = [view]
    have = 0
    while True:
        rel = pos - base
        if rel + 512 > have:
            if pos + 512 > eof:
                break
            if len(P) >= batch:
                done, stop = _settle(acc, H, P, head, payload, S=S, X=X, XI=XI)
                if stop:
                    return S[done] if done < len(S) else pax if pax >= 0 else pos
                del H[: 512 * done], P[:done], S[:done], W[: done if W else 0]
                _drop(X, XI, done)
            try:
                have = preadv(fd, windows, pos)  # into the one reused window
            except OSError:
                break  # the general parser retries and reports it with the offset
            base, rel = pos, 0
            if have < 512:
                break
        try:
            size = int(buf[rel + 124 : rel + 135], 8)
        except ValueError:
            break
        nxt = (pos + 1023 + size) & ~511  # past the header and the 512-padded payload
        if size < 0 or nxt > eof:
            break
        if buf[rel + 156] == _PAX and pax < 0 and size <= _PAX_MAX:
            if rel + 512 + size <= have:  # its payload in the window, searched in place
                matters = search(buf, rel + 512, rel + 512 + size)
            else:
                try:
                    ext = pread(fd, size, pos + 512)
                except OSError:
                    break  # the general parser retries and reports it with the offset
                matters = len(ext) < size or search(ext)
            if not matters:
                add_x(view[rel : rel + 512])
                add_xi(len(P))  # the next member's row
                pax, pos = pos, nxt
                continue
        add_h(view[rel : rel + 512])
        add_p(pos)
        add_s(pos if pax < 0 else pax)
        pax = -1
        if keep:
            add_w(bytes(view[rel + 512 : rel + 512 + size]) if rel + 512 + size <= have else None)
        pos = nxt
    if pax >= 0:
        pos = pax  # no member read after it: the general parser reads both
        del X[-512:], XI[-1:]
    end = pos > 0 and (pos == eof or (pos + 512 <= eof and pread(fd, 512, pos) == _ZERO_BLOCK))  # a clean end
    if not P:
        return -1 if end else pos
    return _Open(H, P, S, X, XI, payload, end, pos)


@dataclass
class _Open:
    """A shard's last headers, read by the lean loop and not yet checked: they wait to be
    checked with those of other shards (:func:`scan_many`)."""

    H: bytearray
    P: array
    S: array  # each member's first byte (its pax header's, if any)
    X: bytearray  # the pax headers folded into members
    XI: array  # their members' rows
    payload: Callable[[list[int], list[int]], list[bytes]]
    end: bool  # the archive ends cleanly after them
    pos: int  # where the loop stopped

    def settled(self, seg: _Segment) -> int:
        """Where the general parser takes over after ``seg`` was checked (-1: nowhere)."""
        if self.end and not seg.stop:
            return -1
        return self.S[seg.done] if seg.done < len(self.S) else self.pos


def _lean_stream(r: _Reader, acc: _Acc, head: int | None) -> int:
    """Stream mode: read through ``r``'s file into one reused buffer, keeping the bytes
    from the held-back sample's first header on; return where the general parser takes
    over (its reader then starts with those bytes)."""
    f = r._f
    readinto: Callable[[Any], int] | None = getattr(f, "readinto", None)
    H = bytearray()  # the pending headers, back to back
    P = array("q")
    S = array("q")  # each member's first byte (its pax header's, if any)
    X, XI = bytearray(), array("q")  # pax headers folded in, and their members' rows
    buf = bytearray(_CHUNK)
    fill, base, pos, at_eof = 0, 0, 0, False
    pax = -1  # the offset of a pax header read for the next member
    need = 512  # bytes from pos the loop needs in the buffer (a header, or a pax header and its payload)
    state = {"buf": buf, "base": 0}

    def payload(members: list[int], sizes: list[int]) -> list[bytes]:
        buf, base = state["buf"], state["base"]
        return [bytes(buf[P[i] + 512 - base : P[i] + 512 - base + n]) for i, n in zip(members, sizes)]

    def read_more(need: int) -> None:
        """Read until ``buf`` holds ``need`` bytes from ``base``, or the stream ends."""
        nonlocal buf, fill, at_eof
        if len(buf) < need:
            grown = bytearray(max(need, 2 * len(buf)))
            grown[:fill] = buf[:fill]
            buf = grown
        while fill < need and not at_eof:
            try:
                if readinto is not None:
                    with memoryview(buf) as mv:
                        got = readinto(mv[fill:])
                else:
                    chunk = f.read(len(buf) - fill)  # type: ignore[union-attr]
                    got = len(chunk)
                    buf[fill : fill + got] = chunk
            except OSError as exc:
                raise ShardError(f"{r.url}: reading at byte offset {base + fill} failed: {exc}") from exc
            if not got:
                at_eof = True
            fill += got or 0

    stop = False
    while True:
        rel = pos - base
        if rel + need > fill:
            if H:
                state["buf"], state["base"] = buf, base
                read = len(P)
                done, stop = _settle(acc, H, P, head, payload, S=S, X=X, XI=XI)
                del H[: 512 * done], P[:done], S[:done]
                _drop(X, XI, done)
                if stop or read * _SPAN < fill:
                    # large samples: the general parser reads past payloads without
                    # keeping them, and the checks cost too much per member here
                    stop = True
                    break
            keep = S[0] if H else pax if pax >= 0 else pos
            if pos + need - keep > _MAX_HELD or at_eof:
                break
            shift = keep - base  # the kept bytes move to the front (keep is inside the buffer)
            if shift:
                with memoryview(buf) as mv:
                    mv[: fill - shift] = mv[shift:fill]
                fill -= shift
            base = keep
            read_more(max(pos + need - base, len(buf) if pos else _PROBE))  # a small first read tells the sample size
            need = 512
            with memoryview(buf) as mv:
                pos, pax = _chain(mv[:fill], base, pos, H, P, S, X, XI, pax)  # the run of plain headers, found in numpy
            rel = pos - base
            if rel + 512 > fill:
                if not at_eof:
                    continue  # the run went past the buffer: read on
                break
        h = buf[rel : rel + 512]
        try:
            size = int(h[124:135], 8)
        except ValueError:
            break
        if size < 0:
            break
        if h[156] == _PAX and pax < 0 and size <= _PAX_MAX:
            if rel + 512 + size > fill:
                if not at_eof:
                    need = 512 + size  # its payload is not all in the buffer: read on
                    continue
            elif not _PAX_MATTERS.search(buf, rel + 512, rel + 512 + size):
                X += h
                XI.append(len(P))  # the next member's row
                pax = pos
                pos += 512 + ((size + 511) & ~511)
                continue
        H += h
        P.append(pos)
        S.append(pos if pax < 0 else pax)
        pax = -1
        pos += 512 + ((size + 511) & ~511)
    if pax >= 0:
        pos = pax  # no member read after it: the general parser reads both
        del X[-512:], XI[-1:]
    if H and not stop:
        rel = pos - base
        end = (at_eof and rel == fill) or (rel + 512 <= fill and buf[rel : rel + 512] == _ZERO_BLOCK)  # a clean end
        state["buf"], state["base"] = buf, base
        done, stop = _settle(acc, H, P, head, payload, final=end, S=S, X=X, XI=XI)
        del H[: 512 * done], P[:done], S[:done]
        if end and not stop:
            return -1
    start = S[0] if H else pos
    if start - base <= fill:
        r._buf, r._base = bytes(buf[max(start - base, 0) : fill]), max(start, base)
    else:
        r._buf, r._base = b"", base + fill
    return start  # the general reader finds the end of the stream itself, as scan_tar would


def _chain(buf: memoryview, base: int, pos: int, H: bytearray, P: array, S: array, X: bytearray, XI: array,
           pax: int) -> tuple[int, int]:
    """Find the run of headers from ``pos`` in a stream buffer with array operations.

    Candidates are the 512-byte blocks with the ustar magic and a size of eleven octal
    digits; the run follows each one's size to the next and stops where the next is
    not a candidate (a block of payload that looks like a header is never on the run:
    it is jumped over). The run's headers are appended to ``H``/``P``/``S``, unchecked,
    as the per-member loop would, and pax headers it may fold are folded into the member
    after them (``X``/``XI``), as that loop does; ``pax`` is the offset of a pax header
    folded into the member at ``pos`` (-1: none). Returns where that loop goes on, and
    the same for the member there.
    """
    first, blocks = (pos - base) // 512, len(buf) // 512
    if blocks - first < 8:
        return pos, pax
    B = np.frombuffer(buf, np.uint8, 512 * blocks).reshape(blocks, 512)[first:]
    cand = np.flatnonzero(B[:, 257] == 117)  # "u": then the rest of "ustar", on those only
    cand = cand[B[cand, 258:262].copy().view(np.uint32).ravel() == _STAR]
    if cand.size < 2 or cand[0] != 0:
        return pos, pax
    D = B[cand, 124:136]
    digits = D[:, :11].astype(np.int64) - 48
    plain = ((digits >= 0) & (digits <= 7)).all(1) & ((D[:, 11] == 0) | (D[:, 11] == 32))
    size = digits @ _POW8_11
    nxt = cand + 1 + (size + 511) // 512
    linked = np.append(nxt[:-1] == cand[1:], False)
    k = int(np.argmin(plain)) if not plain.all() else cand.size  # headers the loop would read the same
    run = int(np.argmin(linked)) + 1  # the run ends at the first header whose next is no candidate
    k = min(k, run)
    kinds = B[cand[:k], 156]
    while k and kinds[k - 1] == _PAX:
        k -= 1  # the loop reads pax headers last on the run (their member is not on it)
    if k == 0:
        return pos, pax
    at = cand[:k]
    offs = (base + (first + at) * 512).astype(np.int64)
    starts = offs.copy()  # each member's first byte
    if pax >= 0:
        starts[0] = pax
    member = np.ones(k, bool)
    paxes = np.flatnonzero(kinds[:k] == _PAX)
    if paxes.size:
        search, base_row, folded = _PAX_MATTERS.search, len(P), []
        for j, n, o in zip(paxes.tolist(), size[paxes].tolist(), ((first + at[paxes]) * 512 + 512).tolist()):
            if (j == 0 and pax >= 0) or (j and not member[j - 1]) or n > _PAX_MAX:
                continue  # a second pax header in a row or a long one: a member row, which the checks refuse
            if not search(buf, o, o + n):  # memoryview: the pattern searches the buffer in place
                member[j] = False
                folded.append(j)
        if folded:
            f = np.asarray(folded)
            starts[f + 1] = offs[f]  # j < k - 1: the run never ends with a pax header
            X += B[at[f]].tobytes()
            XI.extend((base_row + np.cumsum(member)[f + 1] - 1).tolist())  # the member rows after them
    rows = at if member.all() else at[member]
    H += B[rows].tobytes()
    P.frombytes((offs if member.all() else offs[member]).tobytes())
    S.frombytes((starts if member.all() else starts[member]).tobytes())
    return base + (first + int(nxt[k - 1])) * 512, -1


def _drop(X: bytearray, XI: array, done: int) -> None:
    """Forget the pax headers of the member rows ``[0, done)``, settled; renumber the rest."""
    if XI and done:
        j = bisect_left(XI, done)
        del X[: 512 * j], XI[:j]
        XI[:] = array("q", [i - done for i in XI])

