"""Verify an index against its shards: size and change stamp, or a deep rescan.

Invariants:
- ``verify_index`` reads nothing but each shard's (size, change stamp) unless ``deep``;
  a stale, missing or unreachable shard is one :class:`Problem`, not an exception
  (reason ``"unreachable: ..."`` when the store, not the shard, failed; ``"missing: ..."``
  when the shard does not exist; ``"rescan failed: ..."`` when a deep rescan raised);
- a difference only ``deep`` finds is a :class:`Problem` with ``rescan=True``: an update
  scans that shard again only when named (``rescan=``);
- a shard left out when indexed (``on_error="skip"``, size -1) has nothing to compare
  and is passed over;
- ``deep`` rescans a shard's headers with the indexer's own scan (no bucket function
  runs) and compares every indexed sample with what the scan finds at its byte offset:
  its key and length, and every member's extension, payload size and payload offset
  with the member table (the extensions alone for a sample the table does not record);
  the first difference is reported in words (renamed, gone, resized, moved, a member
  renamed or resized), with plain ints.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Hashable, Mapping, Sequence

import numpy as np

from ..core.policy import check_flag
from ..errors import ReadError, ShardError, WdsPadError
from .build import scan_shard
from .codec import load_index
from .record import Index
from .rows import ShardRows
from .shardfile import shard_info

__all__ = ["Problem", "verify_index"]


@dataclass(frozen=True)
class Problem:
    """One stale or missing shard found by :func:`verify_index`.

    Attributes:
        url: The shard, as the index lists it.
        reason: What differs, in words.
        rescan: Its size and change stamp are as indexed (only a deep rescan found the
            difference): an update reuses its rows unless told to scan it again
            (``build_index(..., update=..., rescan=[url])``, ``wds-pad index --update
            --rescan URL``).
    """

    url: str
    reason: str
    rescan: bool = False


def verify_index(index: Index | str, *, deep: bool = False,
                 storage_options: Mapping[str, Any] | None = None) -> list[Problem]:
    """Check every shard's size and change stamp (deep: rescan and compare rows).

    Returns:
        The problems found, one per stale or missing shard (empty when all is well). A
        shard whose store cannot be reached (or found no credentials) is a problem whose
        reason starts with ``"unreachable: "``, one that does not exist ``"missing: "``.
    """
    deep = check_flag("deep", deep)
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
                problems.append(Problem(shard.url, reason, rescan=True))
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
    ids = ids[np.argsort(index.offset[ids], kind="stable")]  # byte order: the first difference first
    keys = [index.key(int(i)) for i in ids]
    # Samples excluded by the bucket function are absent from the index: each indexed
    # sample is matched with the scanned one at its byte offset
    at = {o: j for j, o in enumerate(rows.offset.tolist())}
    was = list(zip(index.offset[ids].tolist(), index.length[ids].tolist()))
    match = [at.get(o, -1) for o, _ in was]
    for k, (o, n), j in zip(keys, was, match):
        if j < 0 or rows.keys[j] != k or int(rows.length[j]) != n:
            by_key = rows.keys.index(k) if k in rows.keys else -1
            now = None if by_key < 0 else (int(rows.offset[by_key]), int(rows.length[by_key]))
            return _difference(k, (o, n), now, rows)
    return _members_differ(index, ids, keys, rows, np.asarray(match, np.int64))


def _members_differ(index: Index, ids: np.ndarray, keys: list[str], rows: ShardRows, js: np.ndarray) -> str:
    """The first sample (in byte order) whose members, as scanned (rows ``js``), are not
    the member table's: extension, payload size or payload offset; or, where the table
    records none, its extensions. Compared in numpy; words only for the one that differs."""
    if not len(ids):
        return ""
    table = {e: i for i, e in enumerate(dict.fromkeys([*index.exts, *rows.exts]))}  # one numbering for both
    remap = lambda exts, masks: _masks(masks, [table[e] for e in exts])  # noqa: E731
    ext_differs = remap(index.exts, index.arrays["exts"][ids]) != remap(rows.exts, rows.mask[js])
    if not index.has_members or rows.member_count is None:
        bad = np.flatnonzero(ext_differs)
        return "" if not bad.size else _describe(index, int(ids[bad[0]]), keys[bad[0]], rows, int(js[bad[0]]))
    ms = index.arrays["member_start"]
    mine = ms[ids].astype(np.int64)
    count = ms[ids + 1].astype(np.int64) - mine
    r_start = np.concatenate([[0], np.cumsum(rows.member_count)])
    now = r_start[js]
    now_n = r_start[js + 1] - now
    bad = ((count == 0) & ext_differs) | ((count > 0) & (count != now_n))
    same = ~bad & (count > 0)
    if same.any():  # members of samples with equal counts, side by side
        flat_i, flat_r = _flat(mine[same], count[same]), _flat(now[same], count[same])
        r_ext, r_size, r_off = rows.member_ext, rows.member_size, rows.member_offset  # set with member_count
        ext_i = np.asarray([table[e] for e in index.exts], np.int64)[index.arrays["member_ext"][flat_i]]
        ext_r = np.asarray([table[e] for e in rows.exts] or [0], np.int64)[r_ext[flat_r]]  # type: ignore[index]
        differ = ((ext_i != ext_r) | (index.arrays["member_size"][flat_i] != r_size[flat_r])  # type: ignore[index]
                  | (index.member_offsets(flat_i, count[same]) != r_off[flat_r]))  # type: ignore[index]
        owner = np.repeat(np.flatnonzero(same), count[same])
        bad[owner[differ]] = True
    first = np.flatnonzero(bad)
    return "" if not first.size else _describe(index, int(ids[first[0]]), keys[first[0]], rows, int(js[first[0]]))


def _flat(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The member rows of samples whose members start at ``starts``, ``counts`` each."""
    first = np.cumsum(counts) - counts
    return np.repeat(starts - first, counts) + np.arange(int(counts.sum()), dtype=np.int64)


def _masks(masks: np.ndarray, bits: list[int]) -> np.ndarray:
    """Extension masks over one table renumbered to ``bits`` (bit ``i`` becomes ``bits[i]``)."""
    out = np.zeros(len(masks), np.uint64)
    for i, b in enumerate(bits):
        out |= ((np.asarray(masks, np.uint64) >> np.uint64(i)) & np.uint64(1)) << np.uint64(b)
    return out


def _describe(index: Index, i: int, key: str, rows: ShardRows, j: int) -> str:
    """In words, how sample ``i``'s members (the member table's, else its extensions) differ
    from scanned row ``j``'s."""
    lo, hi = (int(index.arrays["member_start"][i]), int(index.arrays["member_start"][i + 1])) \
        if index.has_members else (0, 0)
    a = int(np.sum(rows.member_count[:j])) if rows.member_count is not None else 0
    b = a + (int(rows.member_count[j]) if rows.member_count is not None else 0)
    if hi == lo or a == b:
        return _members_now(key, _exts(index.exts, int(index.arrays["exts"][i])), _exts(rows.exts, int(rows.mask[j])))
    was = list(zip((index.exts[e] for e in index.arrays["member_ext"][lo:hi].tolist()),
                   index.arrays["member_size"][lo:hi].tolist(),
                   index.member_offsets(np.arange(lo, hi), np.array([hi - lo])).tolist()))
    r_ext, r_size, r_off = rows.member_ext, rows.member_size, rows.member_offset  # set with member_count
    now = list(zip((rows.exts[e] for e in r_ext[a:b].tolist()), r_size[a:b].tolist(),  # type: ignore[index]
                   r_off[a:b].tolist()))  # type: ignore[index]
    if [e for e, _, _ in was] != [e for e, _, _ in now]:
        return _members_now(key, [e for e, _, _ in was], [e for e, _, _ in now])
    for (e, size, off), (_, size_now, off_now) in zip(was, now):
        if size != size_now:
            return f"sample {key!r}: member {key + '.' + e!r} now holds {size_now} bytes, {size} indexed"
        if off != off_now:
            return (f"sample {key!r}: the payload of member {key + '.' + e!r} now starts {off_now} bytes "
                    f"after the sample's first byte, {off} indexed")
    return ""  # pragma: no cover - only called for a sample that differs


def _exts(table: Sequence[str], mask: int) -> list[str]:
    return [e for b, e in enumerate(table) if mask >> b & 1]


def _members_now(key: str, was: Sequence[str], now: Sequence[str]) -> str:
    return (f"sample {key!r} has members {', '.join('.' + e for e in now) or 'none'} now, "
            f"{', '.join('.' + e for e in was) or 'none'} indexed")


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
