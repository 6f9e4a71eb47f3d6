"""One shard's rows, and the shards' rows joined into one Index.

Invariants:
- a ``ShardRows`` holds only the samples kept (excluded ones are in ``excluded``); its
  ``mask`` bits index its own ``exts`` list, remapped to the index's table on assembly;
- a shard left out (``on_error="skip"``) is a ``ShardRows`` with size -1, no samples and
  its reason in ``info.error`` and ``fault``;
- assembly keeps shard order: shard i of the parts is shard i of the index, and the
  first shard that would push the index past 64 member extensions raises (or, with
  ``on_error="skip"``, is left out, as is any later one that would);
- at most 10,000 excluded samples are listed in the header; the count stays exact;
- the member table (``member_count`` per sample, ``member_ext`` bits of the shard's own
  ``exts``, ``member_size``, ``member_offset`` from the sample's first byte) travels
  with the rows; a shard without one (None) records no members for its samples, and
  streaming parses their headers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Hashable, Mapping, Sequence

import numpy as np

from ..errors import ConfigError, ShardError
from ..io.redact import redact
from .format import Index, ShardInfo, make_index

__all__ = ["ShardRows", "assemble", "fit_exts", "unreadable"]


@dataclass
class ShardRows:
    """One shard's scanned rows (kept samples only), before they join the index."""

    info: ShardInfo
    offset: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    length: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    keys: list[str] = field(default_factory=list)
    buckets: list[Hashable] = field(default_factory=list)
    exts: list[str] = field(default_factory=list)  # bit i of a mask is exts[i]
    mask: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint64))
    excluded: list[dict[str, Any]] = field(default_factory=list)
    nbytes: int = 0
    fault: dict[str, Any] | None = None  # on_error="skip": why the shard (or its rest) was left out
    member_count: np.ndarray | None = None  # members recorded per sample (0: none); None: no table
    member_ext: np.ndarray | None = None    # bit numbers of ``exts`` (uint8), samples back to back
    member_size: np.ndarray | None = None   # payload sizes
    member_offset: np.ndarray | None = None  # payload offsets from the sample's first byte


def unreadable(url: str, exc: Exception) -> ShardRows:
    """The rows of a shard left out with on_error="skip"."""
    rows = ShardRows(ShardInfo(url=url, size=-1, stamp="", samples=0, error=redact(str(exc))))
    rows.fault = {"url": url, "reason": redact(str(exc)), "samples_kept": 0}
    return rows


def assemble(parts: Sequence[ShardRows], bucket_by: Mapping[str, Any], skipped: list[dict[str, Any]], name: str) -> Index:
    ext_table = sorted({e for p in parts for e in _present_exts(p)})
    if len(ext_table) > 64:
        raise ConfigError(f"{len(ext_table)} distinct member extensions; the index records at most 64")
    bit = {e: i for i, e in enumerate(ext_table)}
    bucket_keys: list[Hashable] = []
    bucket_id: dict[Hashable, int] = {}
    shard_col, offset, length, bucket, masks, keys = [], [], [], [], [], []
    mcount, mext, msize, moffset = [], [], [], []
    excluded_samples: list[dict[str, Any]] = []
    for si, p in enumerate(parts):
        n = len(p.keys)
        shard_col.append(np.full(n, si, dtype=np.int32))
        offset.append(p.offset)
        length.append(p.length)
        distinct = set(p.buckets)  # make_index orders the buckets canonically
        for b in distinct:
            if b not in bucket_id:
                bucket_id[b] = len(bucket_keys)
                bucket_keys.append(b)
        if len(distinct) == 1:
            bucket.append(np.full(n, bucket_id[next(iter(distinct))], dtype=np.int64))
        else:
            bucket.append(np.fromiter(map(bucket_id.__getitem__, p.buckets), dtype=np.int64, count=n))
        masks.append(_remap_mask(p, bit))
        if p.member_count is None or len(p.member_count) != n:
            mcount.append(np.zeros(n, np.int64))
        else:
            mcount.append(np.asarray(p.member_count, np.int64))
            to = np.asarray([bit.get(e, 0) for e in p.exts] or [0], np.uint8)
            mext.append(to[np.asarray(p.member_ext, np.intp)])
            msize.append(np.asarray(p.member_size, np.int64))
            moffset.append(np.asarray(p.member_offset, np.int64))
        keys.extend(p.keys)
        excluded_samples.extend(p.excluded)
    cat = lambda xs, dt: np.concatenate(xs).astype(dt) if xs else np.zeros(0, dt)  # noqa: E731
    rows = {"shard": cat(shard_col, np.int32), "offset": cat(offset, np.int64),
            "length": cat(length, np.int64), "bucket": cat(bucket, np.int64), "exts": cat(masks, np.uint64),
            "member_count": cat(mcount, np.int64), "member_ext": cat(mext, np.uint8),
            "member_size": cat(msize, np.int64), "member_offset": cat(moffset, np.int64)}
    excluded = {"samples": excluded_samples, "shards": skipped,
                "count": len(excluded_samples)}
    if len(excluded_samples) > 10_000:  # keep the header small; the count stays exact
        excluded["samples"] = excluded_samples[:10_000]
        excluded["truncated"] = True
    return make_index([p.info for p in parts], rows, bucket_keys, keys, bucket_by=bucket_by,
                      exts=ext_table, excluded=excluded, name=name)


def fit_exts(parts: list[ShardRows], on_error: str) -> list[ShardRows]:
    """The shards whose extensions fit one index's table of 64, in shard order: the first
    shard that would overflow it raises (naming it and its extensions), or with
    on_error="skip" is left out, as are any later ones that would."""
    table: set[str] = set()
    for i, p in enumerate(parts):
        present = _present_exts(p)
        if len(table.union(present)) <= 64:
            table.update(present)
            continue
        new = sorted(set(present) - table)
        exc = ShardError(
            f"shard {redact(p.info.url)!r} adds member extensions {new[:10]}{' ...' if len(new) > 10 else ''} "
            f"to the {len(table)} that the shards before it use: more than the 64 distinct extensions "
            "an index records; give the members fewer distinct suffixes, index these shards "
            "separately, or index with on_error='skip' (--on-error skip) to leave this shard out"
        )
        if on_error != "skip":
            raise exc
        parts[i] = unreadable(p.info.url, exc)
    return parts


def _present_exts(p: ShardRows) -> list[str]:
    """The extensions some kept sample of ``p`` has (an excluded sample's are not recorded)."""
    seen = int(np.bitwise_or.reduce(p.mask)) if len(p.mask) else 0
    return [e for i, e in enumerate(p.exts) if seen >> i & 1]


def _remap_mask(p: ShardRows, bit: Mapping[str, int]) -> np.ndarray:
    """``p``'s masks with its extension bits moved to the index's table."""
    if all(bit.get(e) == i for i, e in enumerate(p.exts)):
        return p.mask  # the same bits (a shard with every extension, in the same order)
    out = np.zeros(len(p.mask), np.uint64)
    for i, e in enumerate(p.exts):
        if e in bit:
            out |= ((p.mask >> np.uint64(i)) & np.uint64(1)) << np.uint64(bit[e])
    return out
