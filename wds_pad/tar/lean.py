"""Columnar tar scanning for the indexer: a lean loop per shard, header checks in numpy.

:func:`scan_rows` finds the same samples as :func:`.scan.scan_tar`, but as columns
(offsets, lengths, keys, extension masks) rather than one object per sample, which is
what an index needs; :func:`scan_many` does it for a group of shards.

How: in seek mode the loop here reads a header, parses only its size field, keeps the
512 bytes and jumps to the next header; in stream mode (:mod:`.leanstream`) the run of
headers in each 8 MiB buffer is found with array operations. Every few thousand headers
(in stream mode: before the buffer moves on; for small shards: the last headers of up to
64 shards together) :func:`.settle.settle_many` checks the kept headers at once in
numpy and turns them into rows. This loop stays inline, not a call per member into the
shared per-member step (:func:`.members.read_samples`): it does no per-member check at all.

A pax extended header (typeflag ``x``) before a member, as ``wds.TarWriter`` and ``tar
--format=posix`` write one before every member, is read too when its records cannot
change how the member is read (``mtime``, ``atime``, ``uname``, ... -- no ``path``,
``linkpath``, ``size``, ``hdrcharset`` or sparse record, see ``settle.PAX_MATTERS``): the
loop checks its payload and folds it into the member after it, whose first byte (``S``,
the sample's offset when it starts one) is then the pax header's; the pax header itself
is checked with the member's (``X``, ``XI``: the pax headers and their members' rows).

Anything else -- other extension headers (GNU long name, global pax, a pax header with a
record that matters, two in a row), a link or directory, a metadata or ``__bad__``
member, a repeated suffix, a bad checksum, truncation -- hands the rest of the shard,
from the start of the sample it occurs in, to the general parser's per-member step
(:func:`.members.read_samples`), which applies every rule and raises the precise error.

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
from array import array
from dataclasses import dataclass
from typing import BinaryIO, Callable, Collection, Sequence

from ..errors import ShardError, TarFormatError
from .columns import Accumulator, ScanRows
from .reader import Reader
from .leanstream import lean_stream
from .members import OnError, check_options, read_samples
from .settle import PAX, PAX_MATTERS, PAX_MAX, ZERO_BLOCK, Segment, drop_pax, settle, settle_many

__all__ = ["scan_many", "scan_rows"]

_WINDOW = 4096  # seek mode: a header, a small payload (.json) and often the next header (and its pax header)
_BATCH = 4096  # seek mode: headers per numpy check
_MAX_WAITING = 64  # scan_many: shards (open files) waiting to be checked together
_REENTER = 4  # seek mode: the lean path stops taking over from the general parser after
_LEAN_RUN = 16  # this many turns in a row that each added fewer than this many samples


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
    wanted, head, mode = check_options(want, head_bytes, on_error)
    out: list[ScanRows | None] = [None] * len(sources)
    waiting: list[tuple[int, Reader, Accumulator, _Open]] = []

    def finish(i: int, r: Reader, acc: Accumulator, start: int) -> None:
        fault = None
        try:
            # -1: the lean path read the archive to its end. Otherwise the general parser
            # reads on; in seek mode the lean path takes over again after one sample (an
            # odd member -- a directory entry first, one long name -- is usually alone),
            # until it has handed back soon after taking over a few times in a row
            short = 0 if r.seek_mode and r.fd >= 0 else _REENTER
            while start >= 0:
                samples = read_samples(r, wanted, head, start)
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
        segs = [Segment(acc, len(o.P), o.payload, o.end) for _, _, acc, o in waiting]
        H = waiting[0][3].H if len(waiting) == 1 else bytearray().join(o.H for *_, o in waiting)
        P, S, X, XI = array("q"), array("q"), bytearray(), array("q")
        for *_, o in waiting:
            XI.extend([i + len(P) for i in o.XI])
            P.extend(o.P)
            S.extend(o.S)
            X += o.X
        settle_many(segs, H, P, head, S, X, XI)
        for (i, r, acc, o), seg in zip(waiting, segs):
            finish(i, r, acc, o.settled(seg))
        waiting.clear()

    for i, (f, url, *mode_of) in enumerate(sources):
        seek = mode_of[0] if mode_of else seekable
        if seek is None:
            seek = bool(getattr(f, "seekable", lambda: False)())
        acc = Accumulator(wanted, report=progress, url=url)
        try:
            r = Reader(f, url, seek)
            if seek and r.fd >= 0:
                start: int | _Open = _lean_seek(r, acc, head)
            elif not seek:
                start = lean_stream(r, acc, head)
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


def _settled(start: int | _Open, acc: Accumulator, head: int | None) -> int:
    """Check a shard's waiting headers now; return where the general parser takes over."""
    if not isinstance(start, _Open):
        return start
    seg = Segment(acc, len(start.P), start.payload, start.end)
    settle_many([seg], start.H, start.P, head, start.S, start.X, start.XI)
    return start.settled(seg)


def _lean_seek(r: Reader, acc: Accumulator, head: int | None, pos: int = 0) -> int | _Open:
    """Seek mode over a local file, from ``pos`` (a sample's first header): return where
    the general parser takes over (-1: nowhere), or the last headers, still to be
    checked."""
    fd, eof, pread = r.fd, r.eof, os.pread
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
    search, add_x, add_xi = PAX_MATTERS.search, X.extend, XI.append
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
                done, stop = settle(acc, H, P, head, payload, S=S, X=X, XI=XI)
                if stop:
                    return S[done] if done < len(S) else pax if pax >= 0 else pos
                del H[: 512 * done], P[:done], S[:done], W[: done if W else 0]
                drop_pax(X, XI, done)
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
        if buf[rel + 156] == PAX and pax < 0 and size <= PAX_MAX:
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
    end = pos > 0 and (pos == eof or (pos + 512 <= eof and pread(fd, 512, pos) == ZERO_BLOCK))  # a clean end
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

    def settled(self, seg: Segment) -> int:
        """Where the general parser takes over after ``seg`` was checked (-1: nowhere)."""
        if self.end and not seg.stop:
            return -1
        return self.S[seg.done] if seg.done < len(self.S) else self.pos
