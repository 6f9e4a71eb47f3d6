"""The lean path in stream mode: one reused buffer, runs of headers found in numpy.

:func:`lean_stream` reads through a shard that cannot seek (a streaming HTTP body, a
pipe) into one buffer, keeping the bytes from the held-back sample's first header on;
:func:`_chain` finds the run of plain headers in the buffer with array operations, and
the loop reads the headers off the run one by one, folding pax headers as the seek loop
of :mod:`.lean` does. Kept headers go to :func:`.settle.settle` before the buffer moves
on; where the lean path stops, the general parser's reader starts with the kept bytes.

Invariants:
    * It accepts what the seek loop accepts, and hands over where it would: the same
      samples, byte ranges, errors and offsets as ``scan_tar`` in stream mode.
    * The run never includes a block of payload that looks like a header: each header's
      size leads to the next, and the run stops where the next is not a candidate.
    * Samples longer than ``_MAX_HELD`` bytes, and shards whose members lie further
      apart than ``_SPAN`` on average, go to the general parser (it reads past payloads
      without keeping them).
"""

from __future__ import annotations

from array import array
from typing import Any, Callable

import numpy as np

from ..errors import ShardError
from .columns import Accumulator
from .reader import Reader
from .settle import PAX, PAX_MATTERS, PAX_MAX, POW8_11, ZERO_BLOCK, drop_pax, settle

__all__ = ["lean_stream"]

_CHUNK = 8 << 20  # stream mode: read size
_PROBE = 1 << 20  # stream mode: the first read
_SPAN = 32 << 10  # stream mode: members further apart on average -> the general parser
_MAX_HELD = 64 << 20  # stream mode: longer samples go to the general parser
_STAR = np.frombuffer(b"star", np.uint32)[0]


def lean_stream(r: Reader, acc: Accumulator, head: int | None) -> int:
    """Stream mode: read through ``r``'s file into one reused buffer, keeping the bytes
    from the held-back sample's first header on; return where the general parser takes
    over (its reader then starts with those bytes)."""
    f = r.file
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
                done, stop = settle(acc, H, P, head, payload, S=S, X=X, XI=XI)
                del H[: 512 * done], P[:done], S[:done]
                drop_pax(X, XI, done)
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
        if h[156] == PAX and pax < 0 and size <= PAX_MAX:
            if rel + 512 + size > fill:
                if not at_eof:
                    need = 512 + size  # its payload is not all in the buffer: read on
                    continue
            elif not PAX_MATTERS.search(buf, rel + 512, rel + 512 + size):
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
        end = (at_eof and rel == fill) or (rel + 512 <= fill and buf[rel : rel + 512] == ZERO_BLOCK)  # a clean end
        state["buf"], state["base"] = buf, base
        done, stop = settle(acc, H, P, head, payload, final=end, S=S, X=X, XI=XI)
        del H[: 512 * done], P[:done], S[:done]
        if end and not stop:
            return -1
    start = S[0] if H else pos
    if start - base <= fill:
        r.buf, r.base = bytes(buf[max(start - base, 0) : fill]), max(start, base)
    else:
        r.buf, r.base = b"", base + fill
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
    size = digits @ POW8_11
    nxt = cand + 1 + (size + 511) // 512
    linked = np.append(nxt[:-1] == cand[1:], False)
    k = int(np.argmin(plain)) if not plain.all() else cand.size  # headers the loop would read the same
    run = int(np.argmin(linked)) + 1  # the run ends at the first header whose next is no candidate
    k = min(k, run)
    kinds = B[cand[:k], 156]
    while k and kinds[k - 1] == PAX:
        k -= 1  # the loop reads pax headers last on the run (their member is not on it)
    if k == 0:
        return pos, pax
    at = cand[:k]
    offs = (base + (first + at) * 512).astype(np.int64)
    starts = offs.copy()  # each member's first byte
    if pax >= 0:
        starts[0] = pax
    member = np.ones(k, bool)
    paxes = np.flatnonzero(kinds[:k] == PAX)
    if paxes.size:
        search, base_row, folded = PAX_MATTERS.search, len(P), []
        for j, n, o in zip(paxes.tolist(), size[paxes].tolist(), ((first + at[paxes]) * 512 + 512).tolist()):
            if (j == 0 and pax >= 0) or (j and not member[j - 1]) or n > PAX_MAX:
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
