"""Columnar tar scanning for the indexer: a lean loop per shard, header checks in numpy.

:func:`scan_rows` finds the same samples as :func:`wds_pad.tarscan.scan_tar`, but as
columns (offsets, lengths, keys, extension masks) rather than one object per sample,
which is what an index needs and about twice as fast.

How: the loop reads a header, parses only its size field, keeps the 512 bytes and jumps
to the next header. Every few thousand headers (in stream mode: before the buffer moves
on) :func:`_settle` checks all kept headers at once in numpy -- checksum, ASCII, plain
regular-file type, no ustar prefix, a terminated size field, a name webdataset groups
without special rules -- then derives keys, extensions and sample boundaries with array
operations, and reads the wanted members' payloads. The last sample of a batch is held
back (its next member may still come).

Anything else -- an extension header (GNU long name, pax), a link or directory, a
metadata or ``__bad__`` member, a repeated suffix, a bad checksum, truncation, the end of
the archive -- hands the rest of the shard, from the start of the sample it occurs in, to
tarscan's general parser, which applies every rule and raises the precise error. So the
two paths cannot disagree: the lean one only ever accepts headers the general one would
read the same way.
"""

from __future__ import annotations

import os
from array import array
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Callable, Collection

import numpy as np
from numpy.lib.stride_tricks import as_strided

from .errors import ConfigError, ShardError, TarFormatError
from .tarscan import OnError, ScannedSample, _options, _Reader, _samples

__all__ = ["ScanRows", "scan_rows"]

_WINDOW = 2048  # seek mode: a header, a small payload (.json) and often the next header
_CHUNK = 8 << 20  # stream mode: read size
_PROBE = 1 << 20  # stream mode: the first read
_SPAN = 32 << 10  # stream mode: members further apart on average -> the general parser
_BATCH = 4096  # seek mode: headers per numpy check
_MAX_HELD = 64 << 20  # stream mode: longer samples go to the general parser
_MAX_EXT = 16  # longer extensions go to the general parser
_IDX8 = np.arange(104, dtype=np.uint8)  # name columns
_EXT_COLS = np.arange(_MAX_EXT, dtype=np.uint8)
_ZERO_BLOCK = bytes(512)
_HIGH = np.uint64(0x8080808080808080)  # the high bit of each byte of a word
_LOW = np.uint64(0x00FF00FF00FF00FF)
_LANES = np.uint64(0x0001000100010001)
_DIGIT_MASK, _DIGITS = np.uint64(0x0000F8F8F8F8F8F8), np.uint64(0x0000303030303030)  # bytes 0-5 in "0".."7"
_OCTAL = np.uint64(0x0000070707070707)
_U3, _U6, _U8, _U12, _U16, _U32, _U48 = (np.uint64(b) for b in (3, 6, 8, 12, 16, 32, 48))
_UFF, _UFFFF = np.uint64(0xFF), np.uint64(0xFFFF)


@dataclass
class ScanRows:
    """The samples of one shard, as columns.

    Attributes:
        url: The shard, for messages.
        offset: Byte offset of each sample's first header (int64).
        length: Bytes up to the end of its last member's padded payload (int64).
        keys: Each sample's webdataset ``__key__``.
        exts: The extension table: bit ``i`` of a mask means ``exts[i]``.
        mask: Each sample's member extensions as a bit mask (uint64).
        data: For each wanted extension, each sample's payload (its first ``head_bytes``
            when that is set), or ``None`` where the sample has no such member.
        fault: With ``on_error="skip"``: why the scan stopped early, else ``None``.
    """

    url: str
    offset: np.ndarray
    length: np.ndarray
    keys: list[str]
    exts: list[str]
    mask: np.ndarray
    data: dict[str, list[bytes | None]]
    fault: TarFormatError | None = None

    def __len__(self) -> int:
        return len(self.keys)

    def sample_data(self, i: int) -> dict[str, bytes]:
        """Sample ``i``'s wanted payloads as ``{ext: bytes}`` (what scan_tar's ``data`` holds)."""
        return {e: col[i] for e, col in self.data.items() if col[i] is not None}  # type: ignore[misc]

    def sample_exts(self, i: int) -> tuple[str, ...]:
        """Sample ``i``'s extensions, in table order."""
        m = int(self.mask[i])
        return tuple(e for b, e in enumerate(self.exts) if m >> b & 1)


@dataclass
class _Acc:
    """Rows as they are found, in archive order."""

    want: frozenset[str]
    offset: list[np.ndarray] = field(default_factory=list)
    length: list[np.ndarray] = field(default_factory=list)
    mask: list[np.ndarray] = field(default_factory=list)
    keys: list[str] = field(default_factory=list)
    data: dict[str, list[bytes | None]] = field(default_factory=dict)
    samples: int = 0
    tail_offset: list[int] = field(default_factory=list)  # the general parser's samples
    tail_length: list[int] = field(default_factory=list)
    tail_mask: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.data = {e: [] for e in sorted(self.want)}
    bits: dict[str, int] = field(default_factory=dict)

    def bit(self, ext: str) -> int:
        b = self.bits.get(ext)
        if b is None:
            if len(self.bits) == 64:
                raise ConfigError("more than 64 distinct member extensions; the index records at most 64")
            b = self.bits[ext] = len(self.bits)
        return b

    def add(self, s: ScannedSample) -> None:
        """One sample from the general parser (which only ever follows the lean path)."""
        self.tail_offset.append(s.offset)
        self.tail_length.append(s.length)
        bits = 0
        for m in s.members:
            bits |= 1 << self.bit(m.ext)
        self.tail_mask.append(bits)
        self.keys.append(s.key)
        for e, col in self.data.items():
            col.append(s.data.get(e))
        self.samples += 1

    def rows(self, url: str, fault: TarFormatError | None) -> ScanRows:
        self.offset.append(np.array(self.tail_offset, np.int64))
        self.length.append(np.array(self.tail_length, np.int64))
        self.mask.append(np.array(self.tail_mask, np.uint64))
        cat = lambda xs, dt: np.concatenate(xs).astype(dt, copy=False)  # noqa: E731
        exts = sorted(self.bits, key=self.bits.__getitem__)
        return ScanRows(url, cat(self.offset, np.int64), cat(self.length, np.int64), self.keys, exts,
                        cat(self.mask, np.uint64), self.data, fault)


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
        ShardError: Reading ``f`` failed.
        ConfigError: An argument is invalid, or the shard has more than 64 extensions.
    """
    wanted, head, mode = _options(want, head_bytes, on_error)
    if seekable is None:
        seekable = bool(getattr(f, "seekable", lambda: False)())
    acc = _Acc(wanted)
    fault = None
    try:
        r = _Reader(f, url, seekable)
        if seekable and r._fd >= 0:
            start = _lean_seek(r, acc, head)
        elif not seekable:
            start = _lean_stream(r, acc, head)
        else:
            start = 0
        if start >= 0:  # -1: the lean path read the archive to its end
            for s in _samples(r, wanted, head, start):
                acc.add(s)
    except TarFormatError as exc:
        if mode is OnError.RAISE:
            raise
        fault = exc
    return acc.rows(url, fault)


def _lean_seek(r: _Reader, acc: _Acc, head: int | None) -> int:
    """Seek mode over a local file; return where the general parser takes over."""
    fd, eof, pread = r._fd, r.eof, os.pread
    H: list[bytes] = []
    P = array("q")  # header offsets
    S = array("q")  # payload sizes
    W: list[tuple[bytes, int]] = []  # the window each header came from, for small payloads
    pos, buf, base = 0, b"", 0
    window = (buf, base)

    def payload(i: int, n: int) -> bytes:
        wbuf, wbase = W[i]
        at = P[i] + 512 - wbase
        if at + n <= len(wbuf):
            return wbuf[at : at + n]
        try:
            got = pread(fd, n, P[i] + 512)
        except OSError as exc:
            raise ShardError(f"{r.url}: reading at byte offset {P[i] + 512} failed: {exc}") from exc
        if len(got) < n:
            raise ShardError(f"{r.url}: the file shrank while it was being scanned (payload at byte "
                             f"offset {P[i] + 512}); index it again once it is complete")
        return got

    # the loop runs once per tar member: locals only, the batch check only on a new window
    add_h, add_p, add_s = H.append, P.append, S.append
    add_w = W.append if acc.want else id  # windows are kept only for wanted payloads (id: a no-op)
    window_size, batch = _WINDOW, _BATCH
    have = 0
    while True:
        rel = pos - base
        if rel + 512 > have:
            if pos + 512 > eof:
                break
            if len(H) >= batch:
                done, stop = _settle(acc, H, P, S, head, payload)
                if stop:
                    return P[done] if done < len(P) else pos
                del H[:done], P[:done], S[:done], W[: done if W else 0]
            try:
                buf = pread(fd, window_size, pos)
            except OSError:
                break  # the general parser retries and reports it with the offset
            base, rel, have = pos, 0, len(buf)
            window = (buf, base)
            if have < 512:
                break
        h = buf[rel : rel + 512]
        try:
            size = int(h[124:135], 8)
        except ValueError:
            break
        nxt = pos + 512 + ((size + 511) & ~511)
        if size < 0 or nxt > eof:
            break
        add_h(h)
        add_p(pos)
        add_s(size)
        add_w(window)
        pos = nxt
    end = pos == eof or (pos + 512 <= eof and pread(fd, 512, pos) == _ZERO_BLOCK)  # a clean end
    done, stop = _settle(acc, H, P, S, head, payload, final=end and pos > 0) if H else (0, False)
    if end and pos > 0 and not stop:
        return -1
    return P[done] if done < len(P) else pos


def _lean_stream(r: _Reader, acc: _Acc, head: int | None) -> int:
    """Stream mode: read through ``r``'s file into one reused buffer, keeping the bytes
    from the held-back sample's first header on; return where the general parser takes
    over (its reader then starts with those bytes)."""
    f = r._f
    readinto: Callable[[Any], int] | None = getattr(f, "readinto", None)
    H: list[bytes] = []
    P = array("q")
    S = array("q")
    buf = bytearray(_CHUNK)
    fill, base, pos, at_eof = 0, 0, 0, False
    state = {"buf": buf, "base": 0}

    def payload(i: int, n: int) -> bytes:
        at = P[i] + 512 - state["base"]
        return bytes(state["buf"][at : at + n])

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
        if rel + 512 > fill:
            if H:
                state["buf"], state["base"] = buf, base
                read = len(H)
                done, stop = _settle(acc, H, P, S, head, payload)
                del H[:done], P[:done], S[:done]
                if stop or read * _SPAN < fill:
                    # large samples: the general parser reads past payloads without
                    # keeping them, and the checks cost too much per member here
                    stop = True
                    break
            keep = P[0] if H else pos
            if pos + 512 - keep > _MAX_HELD or at_eof:
                break
            shift = keep - base  # the kept bytes move to the front (keep is inside the buffer)
            if shift:
                with memoryview(buf) as mv:
                    mv[: fill - shift] = mv[shift:fill]
                fill -= shift
            base = keep
            read_more(max(pos + 512 - base, len(buf) if pos else _PROBE))  # a small first read tells the sample size
            rel = pos - base
            if rel + 512 > fill:
                break
        h = buf[rel : rel + 512]
        try:
            size = int(h[124:135], 8)
        except ValueError:
            break
        if size < 0:
            break
        H.append(h)
        P.append(pos)
        S.append(size)
        pos += 512 + ((size + 511) & ~511)
    if H and not stop:
        rel = pos - base
        end = (at_eof and rel == fill) or (rel + 512 <= fill and buf[rel : rel + 512] == _ZERO_BLOCK)  # a clean end
        state["buf"], state["base"] = buf, base
        done, stop = _settle(acc, H, P, S, head, payload, final=end)
        del H[:done], P[:done], S[:done]
        if end and not stop:
            return -1
    start = P[0] if H else pos
    if start - base <= fill:
        r._buf, r._base = bytes(buf[max(start - base, 0) : fill]), max(start, base)
    else:
        r._buf, r._base = b"", base + fill
    return start  # the general reader finds the end of the stream itself, as scan_tar would


def _popcount(x: np.ndarray) -> np.ndarray:
    if hasattr(np, "bitwise_count"):
        return np.bitwise_count(x).astype(np.int64)
    return np.unpackbits(x.view(np.uint8).reshape(-1, 8), axis=1).sum(1)  # numpy < 2.0


def _settle(acc: _Acc, H: list[bytes], P: array, S: array, head: int | None,
            payload: Callable[[int, int], bytes], final: bool = False) -> tuple[int, bool]:
    """Check the pending headers ``H`` (at offsets ``P``, payload sizes ``S``) and add
    their complete samples to ``acc``.

    Every test is an array operation over all headers (the rare spellings first over the
    whole batch); comparisons of keys are done on 8-byte words.

    With ``final`` (the archive ends cleanly after ``H``) the last sample is added too.

    Returns:
        ``(done, stop)``: members ``[0, done)`` formed the samples added; ``done`` starts
        the held-back sample. ``stop``: a header needs the general parser, which must
        take over at ``P[done]``.
    """
    m = len(H)
    A = np.frombuffer(b"".join(H), np.uint8).reshape(m, 512)
    ok = _headers_ok(A)
    # The names, short in practice: N holds "/" + the first W - 1 bytes + 16 zero bytes
    # (so a 16-byte window at any extension start stays inside the row); W (a multiple
    # of 8) grows until every name's NUL is inside. The leading "/" makes "after the
    # last slash" well defined for every name. Indices below are into N.
    W = 16
    while True:
        N = np.zeros((m, W + _MAX_EXT), np.uint8)
        N[:, 0] = 47
        N[:, 1 : min(W, 101)] = A[:, : min(W - 1, 100)]
        L = (N == 0).argmax(1)  # the NUL ending the name: column W if none before it
        if W == 104 or L.max() < W:
            break
        W = min(2 * W, 104)
    L = L.astype(np.uint8)
    idx = _IDX8[:W]
    names = N[:, :W]
    inname = idx < L[:, None]
    cut = (W - ((names == 47) & inname)[:, ::-1].argmax(1)).astype(np.uint8)  # the file name starts here
    dot = ((names == 46) & (idx >= cut[:, None])).argmax(1)  # 0: none after cut
    elen = L.astype(np.int64) - dot - 1
    ok &= (dot > cut) & ((elen - 1).astype(np.uint64) < _MAX_EXT)
    # rare spellings: tested per row only when some name of the batch (or the bytes after
    # a NUL) has one
    if names.max() >= 128 or (names == 10).any():  # not ASCII (the general parser decodes by locale) or a newline (webdataset's regex)
        ok &= ~(((names >= 128) | (names == 10)) & inname).any(1)
    under = (names[:, :-1] == 95) & (names[:, 1:] == 95)
    if under.any():  # "__x__" metadata, ".__bad__", ".__key__": webdataset's special rules
        under &= inname[:, 1:]
        ok &= ~under[:, 1] & ~under[np.arange(m), np.minimum(dot + 1, W - 2)]
    v = m if ok.all() else int(np.argmin(ok))
    if v == 0:
        return 0, True
    N, dot, L, elen = N[:v], dot[:v], L[:v], elen[:v]
    K = N[:, :W] * (idx < dot[:, None])  # "/" + the key, NUL-padded
    Kw = K.view(np.uint64)
    new = np.ones(v, bool)
    diff = Kw[1:, 0] != Kw[:-1, 0]
    for k in range(1, W // 8):
        diff |= Kw[1:, k] != Kw[:-1, k]
    new[1:] = diff
    starts = np.flatnonzero(new)
    # extensions, lowercased, as 16-byte codes -> ids into a small table
    flat = N.ravel()
    windows = as_strided(flat, shape=(flat.size - _MAX_EXT + 1, _MAX_EXT), strides=(1, 1), writeable=False)
    E = windows[np.arange(1, v * (W + _MAX_EXT) + 1, W + _MAX_EXT) + dot]
    E = E * (_EXT_COLS < elen[:, None])
    E |= ((E - 65) < 26).view(np.uint8) << 5
    codes = E.view(np.uint64)
    lo = codes[:, 0]
    two = bool(codes[:, 1].any())
    ids = np.full(v, -1, np.int64)
    names: list[str] = []
    j = 0
    while j >= 0:
        same = lo == lo[j]
        if two:
            same &= codes[:, 1] == codes[j, 1]
        ids[same] = len(names)
        names.append(E[j].tobytes().rstrip(b"\0").decode("ascii"))
        j = int(np.argmin(ids)) if ids.min() < 0 else -1
    bits = np.array([1 << acc.bit(e) for e in names], np.uint64)[ids]
    group_bits = np.bitwise_or.reduceat(bits, starts)
    counts = np.append(starts[1:], v) - starts
    dup = np.flatnonzero(_popcount(group_bits) != counts)
    stop = v < m
    if dup.size:  # a repeated suffix: the general parser raises with the details
        stop, keep = True, starts < starts[dup[0]] + 1
        starts, group_bits = starts[keep], group_bits[keep]
    # the last sample may go on in the next batch (or is re-parsed by the general parser)
    held = v if final and not stop else int(starts[-1])
    g = starts.size if held == v else starts.size - 1
    if g:
        first = starts[:g]
        last = np.append(starts[1:g], held) - 1
        Pa, Sa = np.frombuffer(P, np.int64, held), np.frombuffer(S, np.int64, held)
        offset = Pa[first]
        acc.offset.append(offset)
        acc.length.append(Pa[last] + 512 + ((Sa[last] + 511) & ~511) - offset)
        acc.mask.append(group_bits[:g])
        acc.keys.extend(b"\0".join(K[first].view(f"S{W}").ravel().tolist()).decode("ascii")[1:].split("\0/"))
        for e, col in acc.data.items():
            base = len(col)
            col.extend([None] * g)
            if e not in names:
                continue
            members = np.flatnonzero(ids[:held] == names.index(e))
            for i, j in zip(members.tolist(), (np.cumsum(new[:held])[members] - 1 + base).tolist()):
                size = S[i]
                col[j] = payload(i, size if head is None or head > size else head)
        acc.samples += g
    return held, stop


def _headers_ok(A: np.ndarray) -> np.ndarray:
    """Which 512-byte headers the lean path may read as plain ustar regular files."""
    # The checksum field as one little-endian word: six octal digits, then NUL (and
    # anything), a space and NUL, or two spaces. tarfile's rarer spellings, and headers
    # whose stored sum is the signed-char one, go to the general parser.
    c = np.ascontiguousarray(A[:, 148:156]).view(np.uint64)[:, 0]
    tail = c >> _U48
    form = ((c & _DIGIT_MASK) == _DIGITS) & (((tail & _UFF) == 0) | (tail == 0x2020) | (tail == 0x0020))
    d = c & _OCTAL  # digit values, most significant first (byte 0)
    d = ((d & _LOW) << _U3) + ((d >> _U8) & _LOW)  # 16-bit lanes: d0d1, d2d3, d4d5
    stored = (((d & _UFFFF) << _U12) + (((d >> _U16) & _UFFFF) << _U6) + ((d >> _U32) & _UFFFF)).astype(np.int64)
    lanes = (c & _LOW) + ((c >> _U8) & _LOW)  # the field's own byte sum, by 16-bit lanes
    field_sum = ((lanes * _LANES) >> _U48).astype(np.int64)
    total = np.add.reduce(A, axis=1, dtype=np.uint32).astype(np.int64) - field_sum + 256
    kind = A[:, 156]
    return (form & (stored == total) & ((kind == 48) | (kind == 0))
            & (A[:, 345] == 0) & ((A[:, 135] == 0) | (A[:, 135] == 32)))
