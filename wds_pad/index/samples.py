"""A scanned shard's samples made rows: each sample's bucket key and cost, the excluded left out.

Invariants:
- a sample's bucket is the bucket function's answer for its key and wanted members
  (read whole again where the function needs more than the scan's ``head_bytes``);
  None excludes it, recorded in ``ShardRows.excluded`` with its URL, offset and key;
- with a cost function every kept sample's cost is recorded; a sample without a valid
  cost is a ``BucketError`` naming shard, byte offset, key and field, or with
  ``on_error="skip"`` is left out and recorded;
- a failing bucket or cost function raises (``on_error="raise"``) naming the sample, or
  leaves it out: never a row with a wrong key;
- a shard's fault (samples after a bad header) keeps the samples before it, and is
  recorded for ``--update`` to scan the shard again.
"""

from __future__ import annotations

from typing import Any, Hashable, Mapping, Sequence

import numpy as np

from ..errors import BucketError, ShardError
from ..io.fs import get_filesystem
from ..io.redact import redact
from ..tar.columns import ScanRows
from ..tar.scan import parse_sample
from .buckets.builtin import SingleBucket
from .buckets.cost import CostFn
from .buckets.protocol import BucketFn
from .layout import cost_values
from .record import ShardInfo
from .rows import ShardRows

__all__ = ["shard_rows"]


def shard_rows(url: str, size: int, stamp: str, scanned: ScanRows, fn: BucketFn, on_error: str,
                storage_options: Mapping[str, Any] | None, cost: CostFn | None = None) -> ShardRows:
    """A scanned shard's rows: bucket keys and costs computed, excluded samples left out."""
    rows = ShardRows(ShardInfo(url=url, size=size, stamp=stamp, samples=0))
    buckets = _bucket_keys(url, fn, scanned, on_error, rows, storage_options)
    if cost is not None:
        values = _costs(url, cost, scanned, buckets, on_error, rows, storage_options)
        buckets = [None if v is None else b for b, v in zip(buckets, values)]
        rows.cost = cost_values([v for v in values if v is not None])
    rows.exts = scanned.exts
    rows.member_count, rows.member_ext = scanned.member_count, scanned.member_ext
    rows.member_size, rows.member_offset = scanned.member_size, scanned.member_offset
    if None not in buckets:
        rows.offset, rows.length, rows.mask = scanned.offset, scanned.length, scanned.mask
        rows.keys, rows.buckets = scanned.keys, buckets
    else:
        keep = np.fromiter((b is not None for b in buckets), dtype=bool, count=len(buckets))
        rows.offset, rows.length, rows.mask = scanned.offset[keep], scanned.length[keep], scanned.mask[keep]
        rows.keys = [k for k, b in zip(scanned.keys, buckets) if b is not None]
        rows.buckets = [b for b in buckets if b is not None]
        if scanned.member_count is not None:  # the kept samples' members
            mkeep = np.repeat(keep, scanned.member_count)
            rows.member_count = scanned.member_count[keep]
            rows.member_ext, rows.member_size = scanned.member_ext[mkeep], scanned.member_size[mkeep]
            rows.member_offset = scanned.member_offset[mkeep]  # type: ignore[index]
    error = None
    if scanned.fault is not None:  # samples before the fault are kept; --update rescans the shard
        error = redact(str(scanned.fault))
        rows.fault = {"url": url, "reason": error, "samples_kept": len(rows.keys)}
    rows.info = ShardInfo(url=url, size=size, stamp=stamp, samples=len(rows.keys), error=error)
    rows.nbytes = size
    return rows


def _bucket_keys(url: str, fn: BucketFn, scanned: ScanRows, on_error: str, rows: ShardRows,
                 storage_options: Mapping[str, Any] | None) -> list[Hashable | None]:
    """Each scanned sample's bucket, or None where it is excluded (recorded in ``rows``)."""
    keys = scanned.keys
    if isinstance(fn, SingleBucket):
        return ["all"] * len(keys)
    needs_more = getattr(fn, "needs_more", None)
    many = getattr(fn, "many", None)
    out: list[Hashable | None] = []
    if many is not None and needs_more is None:
        out = many(keys, scanned.data)  # built-ins: one call per shard; failures come back as exceptions
    else:
        for i, key in enumerate(keys):
            d = scanned.sample_data(i)
            if needs_more is not None and needs_more(d):  # e.g. a JPEG size beyond head_bytes
                d = _whole_members(url, scanned, i, storage_options)
            try:
                out.append(fn(key, d))
            except Exception as exc:  # noqa: BLE001 - a user's bucket function: wrap, name the sample
                out.append(exc)
    types = set(map(type, out))  # usually one or a few str / int types: no exclusion, no failure
    odd = type(None) in types or any(issubclass(t, BaseException) for t in types)
    for i in [i for i, b in enumerate(out) if b is None or isinstance(b, Exception)] if odd else ():
        b = out[i]
        if b is None:
            rows.excluded.append({"url": url, "offset": int(scanned.offset[i]), "key": keys[i],
                                  "reason": "bucket function returned None"})
        else:
            out[i] = _bucket_failure(url, keys[i], int(scanned.offset[i]), b, on_error, rows)
    return out


def _costs(url: str, cost: CostFn, scanned: ScanRows, buckets: Sequence[Hashable | None], on_error: str,
           rows: ShardRows, storage_options: Mapping[str, Any] | None) -> list[Any]:
    """Each scanned sample's cost, None where it is excluded: already by its bucket, or
    now for want of a cost (raised, or with on_error="skip" recorded in ``rows``)."""
    count = scanned.member_count if scanned.member_count is not None else np.zeros(len(scanned), np.int64)
    sizes = np.zeros(int(count.sum()) + 1, np.int64)
    if scanned.member_size is not None:
        np.cumsum(scanned.member_size, out=sizes[1:])
    ends = np.cumsum(count)
    payload = (sizes[ends] - sizes[ends - count]).tolist()
    needs_more = getattr(cost, "needs_more", None)
    out: list[Any] = []
    for i, key in enumerate(scanned.keys):
        if buckets[i] is None:
            out.append(None)
            continue
        d = scanned.sample_data(i) if cost.members else {}
        if needs_more is not None and needs_more(d):  # an image size beyond head_bytes
            d = _whole_members(url, scanned, i, storage_options)
        try:
            out.append(cost(key, d, payload[i]))
        except Exception as exc:  # noqa: BLE001 - the sample's data: wrap, name the sample
            offset = int(scanned.offset[i])
            message = (f"cost {cost.describe()!r} failed for sample {key!r} in {redact(url)!r} at byte offset "
                       f"{offset}: {exc}")
            if on_error == "raise":
                raise BucketError(message + "; or index with on_error='skip' (--on-error skip) to leave "
                                  "such samples out") from exc
            rows.excluded.append({"url": url, "offset": offset, "key": key, "reason": f"cost: {exc}"})
            out.append(None)
    return out


def _whole_members(url: str, scanned: ScanRows, i: int,
                   storage_options: Mapping[str, Any] | None) -> dict[str, bytes]:
    """Sample ``i``'s wanted members in full (the scan read only their first head_bytes):
    its byte range read and parsed again."""
    fs, path = get_filesystem(url, storage_options)
    offset, length, key = int(scanned.offset[i]), int(scanned.length[i]), scanned.keys[i]
    try:
        data = fs.cat_file(path, start=offset, end=offset + length)
    except OSError as exc:
        raise ShardError(f"shard {redact(url)!r}: re-reading sample {key!r} at byte offset {offset} "
                         f"failed: {exc}") from exc
    members = parse_sample(data, redact(url), offset, key)
    return {e: members[e] for e in scanned.data if e in members}


def _bucket_failure(url: str, key: str, offset: int, exc: Exception, on_error: str, rows: ShardRows) -> None:
    message = f"bucket function failed for sample {key!r} in {redact(url)!r} at byte offset {offset}: {exc}"
    if on_error == "raise":
        raise BucketError(message + "; or index with on_error='skip' to leave such samples out") from exc
    rows.excluded.append({"url": url, "offset": offset, "key": key, "reason": str(exc)})
    return None
