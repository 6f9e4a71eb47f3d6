"""Memory mode of the shard cache: a shard held as the futures of its blocks, and the
ranges sliced out of them.

Invariants:
    * A range read from blocks is byte-for-byte ``[start, start + length)`` of the shard,
      whatever block boundaries it spans; an empty range is ``b""``.
    * A compacted shard keeps only the bytes of its listed ranges (sliced once its blocks
      have arrived) and no block; a range it does not keep is one ranged GET.
    * A block's failure reaches every range read from it; a future the reader already
      cancelled is left as it is (:func:`_settle`).
"""

from __future__ import annotations

import concurrent.futures
from typing import Any, Callable

Fetch = Callable[[str, int, int], "concurrent.futures.Future[bytes]"]


def read_blocks(blocks: list[concurrent.futures.Future[bytes]], bb: int, start: int,
                length: int) -> concurrent.futures.Future[bytes]:
    """The bytes ``[start, start + length)`` of a shard held as blocks of ``bb`` bytes,
    once the blocks it spans have arrived."""
    out: concurrent.futures.Future[bytes] = concurrent.futures.Future()
    first, end = start // bb, (start + length - 1) // bb if length else start // bb
    span = blocks[first:end + 1]

    def done(_: Any) -> None:
        if out.done() or not all(b.done() for b in span):
            return
        try:
            joined = b"".join(b.result() for b in span)
        except BaseException as exc:  # noqa: BLE001 - handed to the reader
            out.set_exception(exc)
            return
        lo = start - first * bb
        try:
            out.set_result(joined[lo:lo + length])
        except concurrent.futures.InvalidStateError:
            pass
    if not span:
        out.set_result(b"")
    for b in span:
        b.add_done_callback(done)
    return out


def compact(blocks: list[concurrent.futures.Future[bytes]], bb: int,
            ranges: list[tuple[int, int]]) -> concurrent.futures.Future[dict[tuple[int, int], bytes]]:
    """The bytes of ``ranges`` of a shard held as blocks, by (start, length), once the
    blocks have arrived (the caller then drops the blocks)."""
    kept: concurrent.futures.Future[dict[tuple[int, int], bytes]] = concurrent.futures.Future()

    def done(_: Any) -> None:
        if kept.done() or not all(b.done() for b in blocks):
            return
        try:
            data = [b.result() for b in blocks]
            table = {(st, n): _slice(data, bb, st, n) for st, n in ranges}
        except BaseException as exc:  # noqa: BLE001 - handed to the reads
            _settle(kept, exc=exc)
            return
        _settle(kept, table)
    if not blocks:
        kept.set_result({})
    for b in blocks:
        b.add_done_callback(done)
    return kept


def from_kept(get: Fetch, url: str, kept: concurrent.futures.Future[dict[tuple[int, int], bytes]],
              start: int, length: int, pop: bool) -> concurrent.futures.Future[bytes]:
    """A range of a compacted shard (``pop``: its last read; a range it does not keep:
    one ranged GET through ``get``)."""
    out: concurrent.futures.Future[bytes] = concurrent.futures.Future()

    def done(_: Any) -> None:
        try:
            table = kept.result()
        except BaseException as exc:  # noqa: BLE001 - handed to the reader
            _settle(out, exc=exc)
            return
        data = table.pop((start, length), None) if pop else table.get((start, length))
        if data is None:
            get(url, start, length).add_done_callback(lambda f: _chain_into(f, out))
            return
        _settle(out, data)
    kept.add_done_callback(done)
    return out


def _slice(blocks: list[bytes], bb: int, start: int, length: int) -> bytes:
    """Bytes ``[start, start + length)`` of a shard held as blocks of ``bb`` bytes."""
    first, end = start // bb, (start + length - 1) // bb if length else start // bb
    lo = start - first * bb
    if first == end:
        return blocks[first][lo:lo + length]
    return b"".join(blocks[first:end + 1])[lo:lo + length]


def _settle(fut: concurrent.futures.Future[Any], result: Any = None, exc: BaseException | None = None) -> None:
    """Sets a future's outcome unless it is already set (cancelled by the reader)."""
    try:
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(result)
    except concurrent.futures.InvalidStateError:
        pass


def _chain_into(src: concurrent.futures.Future[bytes], dst: concurrent.futures.Future[bytes]) -> None:
    try:
        _settle(dst, src.result())
    except BaseException as exc:  # noqa: BLE001 - handed to the reader
        _settle(dst, exc=exc)
