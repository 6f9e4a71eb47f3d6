"""The lean path's batch checks: kept headers checked in numpy and turned into rows.

:func:`settle_many` takes the 512-byte headers the lean loops (:mod:`.lean`,
:mod:`.leanstream`) kept (unchecked, back to back, for one shard or several) and checks
them all at once -- checksum, plain regular-file type, no ustar prefix, a terminated
size field, a name webdataset groups without special rules; and the pax headers the
loops folded into members (their payloads already checked there, against
``PAX_MATTERS``): checksum, typeflag ``x``, size field -- then derives keys, extensions
and sample boundaries with array operations and adds the samples, with the wanted
members' payloads, to each shard's :class:`~.columns.Accumulator`. The constants the two
loops share (the pax typeflag and limits, the end-of-archive block) live here too.

Invariants:
    * It accepts only headers the general parser (:mod:`.members`) reads the same way;
      at the first one it does not, the shard's segment stops (``stop``) at the start of
      the sample it is in, and the general parser takes over there.
    * A shard's last sample is held back (its next member may still come) unless its
      archive ends cleanly after the batch; a sample never spans shards.
    * The extension table of one batch holds at most 64 extensions; past that, shards
      checked together are checked one by one, and one shard past it is
      :func:`~.columns.too_many_exts`.
"""

from __future__ import annotations

import re
from array import array
from bisect import bisect_left
from dataclasses import dataclass
from typing import Callable

import numpy as np
from numpy.lib.stride_tricks import as_strided

from .columns import Accumulator, too_many_exts

__all__ = ["PAX", "PAX_MATTERS", "PAX_MAX", "POW8_11", "ZERO_BLOCK", "Segment", "drop_pax", "settle", "settle_many"]

ZERO_BLOCK = bytes(512)
PAX = 120  # typeflag "x": a pax extended header for the next member
PAX_MAX = 4096  # longer pax payloads go to the general parser
# The records a pax header can change a regular member with, for the general parser (its
# headers._PAX_KEYS: path, linkpath, size, GNU.sparse.*) and for tarfile (those and
# hdrcharset): a payload holding none of these bytes, anywhere, is ignored by both (mtime,
# atime, ctime, uid, gid, uname, gname, comment, SCHILY.* ...), so the member after it
# reads as if alone; any other goes to the general parser.
PAX_MATTERS = re.compile(rb"path=|size=|sparse|hdrcharset")
POW8_11 = 8 ** np.arange(10, -1, -1, dtype=np.int64)  # an eleven-digit octal field's place values

_MAX_EXT = 16  # longer extensions go to the general parser
_IDX8 = np.arange(104, dtype=np.uint8)  # name columns
_EXT_COLS = np.arange(_MAX_EXT, dtype=np.uint8)
_LOW = np.uint64(0x00FF00FF00FF00FF)
_LANES = np.uint64(0x0001000100010001)
_DIGIT_MASK, _DIGITS = np.uint64(0x0000F8F8F8F8F8F8), np.uint64(0x0000303030303030)  # bytes 0-5 in "0".."7"
_TAIL_MASK = np.uint64(0xDFDF000000000000)  # bytes 6-7 NUL or space
_OCTAL = np.uint64(0x0000070707070707)
_U3, _U6, _U8, _U12, _U16, _U32, _U48 = (np.uint64(b) for b in (3, 6, 8, 12, 16, 32, 48))
_UFFFF = np.uint64(0xFFFF)


@dataclass
class Segment:
    """One shard's pending headers within a batch checked by :func:`settle_many`.

    Inputs: ``acc`` (where its samples go), ``count`` (its headers, consecutive in the
    batch), ``payload(members, sizes)`` (the first bytes of its members' payloads), ``final``
    (its archive ends cleanly after them). Outputs: ``done`` (its members ``[0, done)``
    formed the samples added; ``done`` starts its held-back sample) and ``stop`` (a
    header needs the general parser, which takes over at that sample).
    """

    acc: Accumulator
    count: int
    payload: Callable[[list[int], list[int]], list[bytes]]
    final: bool = False
    done: int = 0
    stop: bool = False


def settle(acc: Accumulator, H: list[bytes] | bytearray, P: array, head: int | None,
            payload: Callable[[list[int], list[int]], list[bytes]], final: bool = False,
            S: array | None = None, X: bytearray | None = None, XI: array | None = None) -> tuple[int, bool]:
    """:func:`settle_many` for one shard; returns ``(done, stop)``."""
    seg = Segment(acc, len(P), payload, final)
    settle_many([seg], H, P, head, S, X, XI)
    return seg.done, seg.stop


def settle_many(segs: list[Segment], H: list[bytes] | bytearray, P: array, head: int | None,
                 S: array | None = None, X: bytearray | None = None, XI: array | None = None) -> None:
    """Check the pending headers ``H`` (at offsets ``P``) of one or
    more shards (``segs``, back to back) and add each shard's complete samples to its
    ``acc``. Checking the headers of many small shards at once costs about what one
    shard costs: numpy's fixed cost per operation is paid once.

    ``S`` holds each member's first byte where a header came before its own (a pax
    header the lean loop folded in): a sample starting with that member starts there
    (``None``: ``P``); the caller hands over at ``S[done]``. ``X`` holds those pax headers,
    back to back, and ``XI`` their members' rows (ascending; rows past ``H``: a pax header
    whose member is still to come): a member whose pax header fails its checks needs the
    general parser.

    Every test is an array operation over all headers (the rare spellings first over the
    whole batch); comparisons of keys are done on 8-byte words. A shard's last sample is
    held back (its next member may come in the next batch) unless its archive ends.
    """
    A = np.frombuffer(H if isinstance(H, bytearray) else b"".join(H), np.uint8).reshape(-1, 512)
    m = len(A)
    ok = _headers_ok(A)
    xi = np.frombuffer(XI, np.int64) if XI else None
    if xi is not None:
        XA = np.frombuffer(X, np.uint8).reshape(-1, 512)  # type: ignore[arg-type]
        if xi[-1] >= m:  # a member still to come
            XA, xi = XA[xi < m], xi[xi < m]
        if xi.size:
            ok[xi] &= _pax_headers_ok(XA)
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
    # each shard is usable up to its first header that needs the general parser
    counts_in = np.array([seg.count for seg in segs], np.int64)
    seg_end = np.cumsum(counts_in)
    seg_first = seg_end - counts_in
    seg_of = np.repeat(np.arange(len(segs)), counts_in)
    bad = np.flatnonzero(~ok)
    at = np.searchsorted(bad, seg_first)
    cut_at = np.minimum(np.where(at < bad.size, bad[np.minimum(at, max(bad.size - 1, 0))] if bad.size else m, m), seg_end)
    valid = np.arange(m) < cut_at[seg_of]
    K = names * (idx < dot[:, None])  # "/" + the key, NUL-padded
    Kw = K.view(np.uint64)
    new = np.ones(m, bool)
    diff = Kw[1:, 0] != Kw[:-1, 0]
    for k in range(1, W // 8):
        diff |= Kw[1:, k] != Kw[:-1, k]
    new[1:] = diff
    new[seg_first] = True  # a sample never spans shards
    # extensions, lowercased, as 16-byte codes -> ids into a small table
    flat = N.ravel()
    windows = as_strided(flat, shape=(flat.size - _MAX_EXT + 1, _MAX_EXT), strides=(1, 1), writeable=False)
    E = windows[np.arange(1, m * (W + _MAX_EXT) + 1, W + _MAX_EXT) + dot]
    E = E * (_EXT_COLS < elen[:, None])
    E |= ((E - 65) < 26).view(np.uint8) << 5
    codes = E.view(np.uint64)
    lo = codes[:, 0]
    two = bool(codes[:, 1].any())
    ids = np.where(valid, -1, 64)  # rows past a shard's cut get no extension
    exts: list[str] = []
    j = int(np.argmin(ids)) if ids.size and ids.min() < 0 else -1
    while j >= 0:
        if len(exts) == 64:
            if len(segs) > 1:  # shards checked together: each on its own (each may fit)
                for seg, lo_s, hi_s in zip(segs, seg_first.tolist(), seg_end.tolist()):
                    x_s, x_h = None, None  # the shard's own pax headers
                    if xi is not None:
                        cut_x = slice(*np.searchsorted(xi, [lo_s, hi_s]).tolist())
                        x_s, x_h = array("q", (xi[cut_x] - lo_s).tolist()), bytearray(XA[cut_x].tobytes())
                    settle_many([seg], bytearray(A[lo_s:hi_s].tobytes()), P[lo_s:hi_s], head,
                                 None if S is None else S[lo_s:hi_s], x_h, x_s)
                return
            new_ext = E[j].tobytes().rstrip(b"\0").decode("ascii")
            raise too_many_exts(segs[0].acc.url, [*segs[0].acc.bits, *exts, new_ext])
        same = lo == lo[j]
        if two:
            same &= codes[:, 1] == codes[j, 1]
        ids[same & valid] = len(exts)
        exts.append(E[j].tobytes().rstrip(b"\0").decode("ascii"))
        j = int(np.argmin(ids)) if ids.min() < 0 else -1
    starts = np.flatnonzero(new)
    bits = np.where(valid, np.left_shift(np.uint64(1), np.minimum(ids, 63).astype(np.uint64)), np.uint64(0))
    group_bits = np.bitwise_or.reduceat(bits, starts)
    members = np.add.reduceat(valid.astype(np.int64), starts)
    dup = (_popcount(group_bits) != members) & (members > 0)  # a repeated suffix
    group_seg = seg_of[starts]
    emit = members > 0
    ends = np.append(starts[1:], m)
    Pa = np.frombuffer(P, np.int64, m)
    Ss = Pa if S is None else np.frombuffer(S, np.int64, m)
    Sa = (A[:, 124:135].astype(np.int64) - 48) @ POW8_11  # payload sizes (eleven digits: checked)
    for s, seg in enumerate(segs):
        lo_g, hi_g = (int(x) for x in np.searchsorted(group_seg, [s, s + 1]))
        nv = int(np.count_nonzero(emit[lo_g:hi_g]))  # groups with usable members: a prefix
        d = np.flatnonzero(dup[lo_g : lo_g + nv])
        if d.size:  # a repeated suffix: complete samples before it, the general parser from it
            seg.stop, g = True, int(d[0])
            held = int(starts[lo_g + g])
        elif int(cut_at[s]) < int(seg_end[s]) or not seg.final:
            # a header needs the general parser (stop), or the batch ends (the next member
            # may belong to the last sample): its last sample is held back
            seg.stop = int(cut_at[s]) < int(seg_end[s])
            g = max(nv - 1, 0)
            held = int(starts[lo_g + g]) if nv else int(cut_at[s])
        else:  # the archive ends cleanly after this batch: every sample is complete
            g, held = nv, int(seg_end[s])
        seg.done = held - int(seg_first[s])
        if not g:
            continue
        g_end = lo_g + g
        first = starts[lo_g:g_end]
        last = ends[lo_g:g_end] - 1
        offset = Ss[first]  # a pax header before the first member included
        acc = seg.acc
        if acc.tail_offset:
            acc.flush()
        acc.offset.append(offset)
        acc.length.append(Pa[last] + 512 + ((Sa[last] + 511) & ~511) - offset)
        seen = int(np.bitwise_or.reduce(group_bits[lo_g:g_end]))
        local = [1 << acc.bit(e) if seen >> i & 1 else 0 for i, e in enumerate(exts)]
        acc.mask.append(_remap(group_bits[lo_g:g_end], local))
        # the member table: every header of these samples is a plain member
        rows_m = slice(int(first[0]), int(ends[g_end - 1]))
        acc.mcount.append((ends[lo_g:g_end] - first).astype(np.int64))
        bitno = np.asarray([acc.bit(e) if seen >> i & 1 else 0 for i, e in enumerate(exts)] or [0], np.uint8)
        acc.mext.append(bitno[ids[rows_m]])
        acc.msize.append(Sa[rows_m])
        acc.moffset.append(Pa[rows_m] + 512 - np.repeat(offset, ends[lo_g:g_end] - first))
        acc.keys.extend(b"\0".join(K[first].view(f"S{W}").ravel().tolist()).decode("ascii")[1:].split("\0/"))
        base_i = int(seg_first[s])
        for e, col in acc.data.items():
            base = len(col)
            col.extend([None] * g)
            if e not in exts:
                continue
            span = slice(int(first[0]), int(ends[g_end - 1]))
            wanted = np.flatnonzero(ids[span] == exts.index(e)) + span.start
            sample_of = np.searchsorted(first, wanted, side="right") - 1
            sizes = Sa[wanted] if head is None else np.minimum(Sa[wanted], head)
            got = seg.payload((wanted - base_i).tolist(), sizes.tolist())
            if len(got) == g:  # every sample has the member (at most once: no repeated suffix)
                col[base:] = got
            else:
                for jj, data in zip((sample_of + base).tolist(), got):
                    col[jj] = data
        acc.samples += g
        if acc.report is not None:  # a large shard shows progress batch by batch
            acc.report(acc.samples - acc.reported)
            acc.reported = acc.samples


def drop_pax(X: bytearray, XI: array, done: int) -> None:
    """Forget the pax headers of the member rows ``[0, done)``, settled; renumber the rest."""
    if XI and done:
        j = bisect_left(XI, done)
        del X[: 512 * j], XI[:j]
        XI[:] = array("q", [i - done for i in XI])


def _popcount(x: np.ndarray) -> np.ndarray:
    if hasattr(np, "bitwise_count"):
        return np.bitwise_count(x).astype(np.int64)
    return np.unpackbits(x.view(np.uint8).reshape(-1, 8), axis=1).sum(1)  # numpy < 2.0


def _remap(group_bits: np.ndarray, local: list[int]) -> np.ndarray:
    """Masks over the batch's extension table -> masks over a shard's own table."""
    if all(bit == 1 << i for i, bit in enumerate(local)):
        return group_bits  # the same table (one shard, or shards alike)
    out = np.zeros(group_bits.size, np.uint64)
    for i, bit in enumerate(local):
        if bit:
            out |= np.where((group_bits >> np.uint64(i)) & np.uint64(1), np.uint64(bit), np.uint64(0))
    return out


def _headers_ok(A: np.ndarray) -> np.ndarray:
    """Which 512-byte headers the lean path may read as plain ustar regular files."""
    kind = A[:, 156]
    return _sum_and_size_ok(A) & ((kind == 48) | (kind == 0)) & (A[:, 345] == 0)


def _pax_headers_ok(A: np.ndarray) -> np.ndarray:
    """Which 512-byte pax headers (typeflag ``x``) the general parser reads with the
    checks the lean path makes (its name and prefix it ignores)."""
    return _sum_and_size_ok(A) & (A[:, 156] == PAX)


def _sum_and_size_ok(A: np.ndarray) -> np.ndarray:
    """Headers with a checksum and a size field the general parser's quick path reads."""
    # The checksum field as one little-endian word: six octal digits, then two bytes that
    # are NUL or space ("%06o\0 " from tarfile and GNU tar). tarfile's rarer spellings,
    # and headers whose stored sum is the signed-char one, go to the general parser.
    c = np.ascontiguousarray(A[:, 148:156]).view(np.uint64)[:, 0]
    form = ((c & _DIGIT_MASK) == _DIGITS) & ((c & _TAIL_MASK) == 0)  # then NUL or space, twice
    d = c & _OCTAL  # digit values, most significant first (byte 0)
    d = ((d & _LOW) << _U3) + ((d >> _U8) & _LOW)  # 16-bit lanes: d0d1, d2d3, d4d5
    stored = (((d & _UFFFF) << _U12) + (((d >> _U16) & _UFFFF) << _U6) + ((d >> _U32) & _UFFFF)).astype(np.int64)
    lanes = (c & _LOW) + ((c >> _U8) & _LOW)  # the field's own byte sum, by 16-bit lanes
    field_sum = ((lanes * _LANES) >> _U48).astype(np.int64)
    # an all-ASCII batch sums below 2**16 a header: half the width, half the time
    wide = np.uint16 if A.max() < 128 else np.uint32
    total = np.add.reduce(A, axis=1, dtype=wide).astype(np.int64) - field_sum + 256
    digits = A[:, 124:135]  # the size: eleven octal digits (int() would take rarer spellings too)
    return form & (stored == total) & ((A[:, 135] & 0xDF) == 0) & ((digits & 0xF8) == 0x30).all(1)
