"""Rows assembled where rows are: one shard's rows, and rows joined into one Index.

:class:`ShardRows` holds one scanned shard's rows; :func:`assemble` joins the shards'
rows and :func:`make_index` (rows in shard order, any bucket keys) builds the Index from
them, as :func:`grouped_index` does for rows whose bucket ids are already canonical (a
version-1 file converted, :mod:`.codec`).

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
  streaming parses their headers;
- an Index made here has its buckets in canonical order (``bucket_order``) and its rows
  grouped by bucket, stable (shard order, then byte order, inside each), every column
  as narrow as its values allow;
- with costs (``cost`` per sample, every shard's), the cost order is each bucket's rows
  sorted by cost, equal costs by row id (one stable sort), as offsets in the bucket.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Hashable, Mapping, Sequence

import numpy as np

from ..errors import ConfigError, ShardError
from ..io.redact import redact
from ..core.dataset import bucket_order
from ..tar.members import key_bytes
from .layout import column_dtypes, cost_dtype, cost_values, member_dtypes, narrowest_int
from .record import Index, ShardInfo

__all__ = ["ShardRows", "assemble", "cost_order", "fit_exts", "grouped_index", "make_index", "unreadable"]


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
    cost: np.ndarray | None = None  # each kept sample's cost (``cost_values``); None: no costs


def unreadable(url: str, exc: Exception) -> ShardRows:
    """The rows of a shard left out with on_error="skip"."""
    rows = ShardRows(ShardInfo(url=url, size=-1, stamp="", samples=0, error=redact(str(exc))))
    rows.fault = {"url": url, "reason": redact(str(exc)), "samples_kept": 0}
    return rows


def assemble(parts: Sequence[ShardRows], bucket_by: Mapping[str, Any], skipped: list[dict[str, Any]], name: str,
             *, cost_kind: str | None = None, path: str | None = None) -> Index:
    """The Index of the shards' rows (in shard order), at ``path`` (where it will be
    written: its digest is of that file), with costs when ``cost_kind`` is given."""
    ext_table = sorted({e for p in parts for e in _present_exts(p)})
    if len(ext_table) > 64:
        raise ConfigError(f"{len(ext_table)} distinct member extensions; the index records at most 64")
    bit = {e: i for i, e in enumerate(ext_table)}
    bucket_keys: list[Hashable] = []
    bucket_id: dict[Hashable, int] = {}
    shard_col, offset, length, bucket, masks, keys = [], [], [], [], [], []
    mcount, mext, msize, moffset, costs = [], [], [], [], []
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
        if cost_kind is not None:
            costs.append(p.cost if p.cost is not None else np.zeros(0, np.int64))
        keys.extend(p.keys)
        excluded_samples.extend(p.excluded)
    cat = lambda xs, dt: np.concatenate(xs).astype(dt) if xs else np.zeros(0, dt)  # noqa: E731
    rows = {"shard": cat(shard_col, np.int32), "offset": cat(offset, np.int64),
            "length": cat(length, np.int64), "bucket": cat(bucket, np.int64), "exts": cat(masks, np.uint64),
            "member_count": cat(mcount, np.int64), "member_ext": cat(mext, np.uint8),
            "member_size": cat(msize, np.int64), "member_offset": cat(moffset, np.int64)}
    if cost_kind is not None:
        floats = any(c.dtype.kind == "f" for c in costs)
        rows["cost"] = cat(costs, np.float64 if floats else np.int64)
    excluded = {"samples": excluded_samples, "shards": skipped,
                "count": len(excluded_samples)}
    if len(excluded_samples) > 10_000:  # keep the header small; the count stays exact
        excluded["samples"] = excluded_samples[:10_000]
        excluded["truncated"] = True
    return make_index([p.info for p in parts], rows, bucket_keys, keys, bucket_by=bucket_by,
                      exts=ext_table, excluded=excluded, name=name, cost_kind=cost_kind, path=path)


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


def make_index(
    shards: Sequence[ShardInfo], rows: Mapping[str, np.ndarray], bucket_keys: Sequence[Hashable],
    keys: Sequence[str], *, bucket_by: Mapping[str, Any], exts: Sequence[str],
    excluded: Mapping[str, Any] | None = None, name: str = "index", cost_kind: str | None = None,
    path: str | None = None,
) -> Index:
    """Assemble an Index from per-sample rows in shard order (``rows["bucket"]`` indexes
    ``bucket_keys``): buckets re-numbered in canonical order, rows grouped by bucket.

    With ``cost_kind``, ``rows["cost"]`` holds each sample's cost (non-negative, finite);
    ``path`` is where the index will be written (its shard URLs stored relative to it)."""
    ordered = sorted(set(bucket_keys), key=bucket_order)
    remap = np.asarray([ordered.index(k) for k in bucket_keys], dtype=np.int32)
    bucket = remap[np.asarray(rows["bucket"], np.int64)] if len(bucket_keys) else np.zeros(0, np.int32)
    key_offsets, key_bytes = _pack_keys(keys)
    return grouped_index(shards, ordered, {**rows, "bucket": bucket}, key_offsets, key_bytes, bucket_by=bucket_by,
                    exts=exts, excluded=excluded, name=name, cost_kind=cost_kind, path=path)


def grouped_index(shards: Sequence[ShardInfo], buckets: Sequence[Hashable], rows: Mapping[str, np.ndarray],
             key_offsets: np.ndarray, keys: np.ndarray, *, bucket_by: Mapping[str, Any], exts: Sequence[str],
             excluded: Mapping[str, Any] | None, name: str, cost_kind: str | None = None,
             path: str | None = None) -> Index:
    """An Index of rows given in shard order with canonical bucket ids: rows grouped by
    bucket (stable, so shard then byte order inside each), every column narrowed."""
    bucket = np.asarray(rows["bucket"])
    n = bucket.size
    order = np.argsort(bucket, kind="stable") if n else np.zeros(0, np.int64)
    bounds = np.zeros(len(buckets) + 1, dtype=np.int64)
    np.cumsum(np.bincount(bucket, minlength=len(buckets))[: len(buckets)], out=bounds[1:])
    key_offsets, key_bytes = _gather_keys(np.asarray(key_offsets, np.int64), np.asarray(keys, np.uint8), order)
    offset, length = np.asarray(rows["offset"], np.int64), np.asarray(rows["length"], np.int64)
    dt = column_dtypes(len(shards), int(offset.max()) if n else 0, int(length.max()) if n else 0,
                       int(key_offsets[-1]), len(exts))
    arrays = {
        "bucket_offsets": bounds,
        "shard": np.asarray(rows["shard"])[order].astype(dt["shard"]),
        "offset": offset[order].astype(dt["offset"]),
        "length": length[order].astype(dt["length"]),
        "exts": np.asarray(rows["exts"], np.uint64)[order].astype(dt["exts"]),
        "key_offsets": key_offsets.astype(dt["key_offsets"]),
        "keys": key_bytes,
    }
    if "member_count" in rows:  # the member table, gathered like the keys
        count = np.asarray(rows["member_count"], np.int64)
        start = np.zeros(n + 1, np.int64)
        np.cumsum(count, out=start[1:])
        new_start, ext = _gather_keys(start, np.asarray(rows["member_ext"], np.uint8), order)
        _, size = _gather_keys(start, np.asarray(rows["member_size"], np.int64), order)
        _, moff = _gather_keys(start, np.asarray(rows["member_offset"], np.int64), order)
        mdt = member_dtypes(int(new_start[-1]), int(size.max()) if size.size else 0,
                            int(moff.max()) if moff.size else 0)
        arrays.update(member_start=new_start.astype(mdt["member_start"]), member_ext=ext,
                      member_size=size.astype(mdt["member_size"]), member_offset=moff.astype(mdt["member_offset"]))
    if cost_kind is not None:
        cost = cost_values(np.asarray(rows["cost"]))[order]
        if n and not (bool(np.all(np.isfinite(cost))) and cost.min() >= 0):
            raise ConfigError(f"index {name!r}: costs must be non-negative finite numbers (the smallest given is "
                              f"{cost.min()!r})")
        integral = cost.dtype.kind == "i"
        arrays["cost"] = cost.astype(cost_dtype(integral, cost.max() if n else 0))
        arrays["cost_order"] = cost_order(cost, bounds)
    return Index(shards=tuple(shards), buckets=tuple(buckets), arrays=arrays, bucket_by=dict(bucket_by),
                 exts=tuple(exts), excluded=dict(excluded or {}), name=name, path=path, cost_kind=cost_kind)


def cost_order(cost: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    """Each bucket's rows in cost order, equal costs by row id, as offsets from the
    bucket's first row (``bounds``: the bucket offsets), in the narrowest signed type
    holding the largest bucket."""
    sizes = np.diff(bounds)
    dt = narrowest_int(max(int(sizes.max()) - 1, 0) if sizes.size else 0)
    if not cost.size:
        return np.zeros(0, dt)
    bucket = np.repeat(np.arange(sizes.size, dtype=np.int64), sizes)
    order = np.lexsort((cost, bucket))  # stable: equal costs keep row order
    return (order - np.repeat(bounds[:-1], sizes)).astype(dt)


def _pack_keys(keys: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """(offsets, bytes) of ``keys`` back to back: key i is ``bytes[offsets[i]:offsets[i + 1]]``,
    each key's bytes those of ``key_bytes`` (UTF-8; a name's undecodable bytes as they were)."""
    offsets = np.zeros(len(keys) + 1, dtype=np.int64)
    if not keys:
        return offsets, np.zeros(0, np.uint8)
    joined = np.frombuffer(key_bytes("\0".join(keys)), np.uint8)
    ends = np.flatnonzero(joined == 0)
    if len(ends) != len(keys) - 1:  # a key holds a NUL (never one from a tar name): one by one
        encoded = [key_bytes(k) for k in keys]
        np.cumsum([len(k) for k in encoded], out=offsets[1:])
        return offsets, np.frombuffer(b"".join(encoded), np.uint8)
    offsets[1:-1] = ends - np.arange(len(ends))
    offsets[-1] = len(joined) - len(ends)
    return offsets, joined[joined != 0] if len(ends) else joined.copy()


def _gather_keys(offsets: np.ndarray, blob: np.ndarray, order: np.ndarray,
                 chunk: int = 1 << 20) -> tuple[np.ndarray, np.ndarray]:
    """The key table of rows ``order`` (offsets, bytes), gathered in bounded chunks (any
    variable-length section: the member table too)."""
    lengths = (offsets[1:] - offsets[:-1])[order]
    new = np.zeros(order.size + 1, dtype=np.int64)
    np.cumsum(lengths, out=new[1:])
    out = np.empty(int(new[-1]), dtype=blob.dtype)
    for lo in range(0, order.size, chunk):
        hi = min(lo + chunk, order.size)
        ln = lengths[lo:hi]
        src = np.repeat(offsets[order[lo:hi]] - new[lo:hi], ln) + np.arange(int(new[lo]), int(new[hi]), dtype=np.int64)
        out[int(new[lo]) : int(new[hi])] = blob[src]
    return new, out
