"""Verify an index against its shards: size and change stamp, or a deep rescan.

Invariants:
- ``verify_index`` reads nothing but each shard's (size, change stamp) unless ``deep``;
  a stale, missing or unreachable shard is one :class:`Problem`, not an exception
  (reason ``"unreachable: ..."`` when the store, not the shard, failed; ``"missing: ..."``
  when the shard does not exist; ``"rescan failed: ..."`` when a deep rescan raised);
- a shard left out when indexed (``on_error="skip"``, size -1) has nothing to compare
  and is passed over;
- ``deep`` rescans a shard's headers with the indexer's own scan (no bucket function
  runs) and compares every indexed sample by key: its byte offset and length; the first
  difference is reported in words (renamed, gone, resized, moved).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Hashable, Mapping

import numpy as np

from ..errors import ReadError, ShardError, WdsPadError
from .build import scan_shard
from .codec import load_index
from .record import Index
from .rows import ShardRows
from .shardfile import shard_info

__all__ = ["Problem", "verify_index"]


@dataclass(frozen=True)
class Problem:
    """One stale or missing shard found by :func:`verify_index`."""

    url: str
    reason: str


def verify_index(index: Index | str, *, deep: bool = False,
                 storage_options: Mapping[str, Any] | None = None) -> list[Problem]:
    """Check every shard's size and change stamp (deep: rescan and compare rows).

    Returns:
        The problems found, one per stale or missing shard (empty when all is well). A
        shard whose store cannot be reached (or found no credentials) is a problem whose
        reason starts with ``"unreachable: "``, one that does not exist ``"missing: "``.
    """
    if isinstance(index, str):
        index = load_index(index, storage_options=storage_options)
    problems: list[Problem] = []
    fn = _DescribedOnly(index.bucket_by)
    for si, shard in enumerate(index.shards):
        if shard.size < 0:
            continue  # missing when indexed (on_error="skip"): nothing recorded to compare
        try:
            size, stamp = shard_info(shard.url, storage_options)
        except ReadError as exc:  # the store, not the shard: nothing is known about it
            problems.append(Problem(shard.url, f"unreachable: {exc}"))
            continue
        except ShardError as exc:
            problems.append(Problem(shard.url, f"missing: {exc}"))
            continue
        if size != shard.size:
            problems.append(Problem(shard.url, f"size {size} != indexed {shard.size}"))
            continue
        if stamp != shard.stamp:
            problems.append(Problem(shard.url, f"change stamp {stamp!r} != indexed {shard.stamp!r}"))
            continue
        if deep:
            reason = _deep_compare(index, si, fn, storage_options)
            if reason:
                problems.append(Problem(shard.url, reason))
    return problems


class _DescribedOnly:
    """A bucket function that reads nothing: deep verification compares byte ranges and keys."""

    members: tuple[str, ...] = ()
    head_bytes = None

    def __init__(self, description: Mapping[str, Any]) -> None:
        self._description = dict(description)

    def __call__(self, key: str, data: Mapping[str, bytes]) -> Hashable:
        return 0

    def describe(self) -> dict[str, Any]:
        return self._description


def _deep_compare(index: Index, si: int, fn: Any, storage_options: Mapping[str, Any] | None) -> str:
    url = index.shards[si].url
    on_error = "raise" if index.shards[si].error is None else "skip"  # a known fault is no news
    try:
        rows = scan_shard(url, fn, on_error, storage_options)
    except WdsPadError as exc:
        return f"rescan failed: {exc}"
    ids = np.flatnonzero(index.shard == si)
    keys = [index.key(int(i)) for i in ids]
    # Samples excluded by the bucket function are absent from the index: compare by key.
    got = dict(zip(rows.keys, zip(rows.offset.tolist(), rows.length.tolist())))
    for i, k in zip(ids, keys):
        was = (int(index.offset[i]), int(index.length[i]))
        now = got.get(k)
        if now != was:
            return _difference(k, was, now, rows)
    return ""


def _difference(key: str, was: tuple[int, int], now: tuple[int, int] | None, rows: ShardRows) -> str:
    """What differs for one indexed sample, in words (plain ints)."""
    (offset, length) = was
    if now is None:
        at = np.flatnonzero(rows.offset == offset)
        if at.size:
            other = rows.keys[int(at[0])]
            return (f"sample {key!r} was renamed: the sample at byte offset {offset} is now key {other!r} "
                    f"({int(rows.length[int(at[0])])} bytes; indexed: {length} bytes)")
        return f"sample {key!r} is gone: indexed at byte offset {offset} ({length} bytes), no such key now"
    if now[0] == offset:
        return f"sample {key!r} at byte offset {offset} changed size: {now[1]} bytes now, {length} indexed"
    return (f"sample {key!r} moved to another offset: indexed at byte offset {offset} ({length} bytes), "
            f"now at {now[0]} ({now[1]} bytes)")

