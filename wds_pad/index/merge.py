"""Merging index files without holding them: the parts of a distributed build become one.

:func:`merged_parts` gives the bytes of the index of several part files' shards, in part
order, through :func:`.codec.columns_parts`: the tables and one slice of one part at a
time (``wds_pad.index.distributed`` writes them).

Invariants:
- the bytes are identical to ``serialize`` of one build of all the shards: buckets and
  extensions re-numbered in the canonical tables, rows grouped by bucket, then part, then
  row, every column as narrow as the merged values allow;
- parts bucketed differently, or using more than 64 distinct member extensions
  together, are refused (:class:`IndexFormatError`); a part without a member table
  records no members for its samples, and a part from before ``member_offset`` has its
  offsets derived (:func:`.layout.plain_offsets`);
- costs are merged when every part has them, of one kind (else refused): the column
  as the rows, the cost order bucket by bucket from the parts' own orders (their sorted
  runs merged, equal costs in merged row order); a bucket's costs are the only thing
  held whole;
- the merged file's shard URLs are stored relative to ``path`` where they sit beside or
  below it, as a build written there stores them.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np

from ..core.dataset import bucket_order
from ..errors import IndexFormatError
from .codec import columns_parts
from .layout import ROW_ARRAYS, cost_dtype, narrowest_int, plain_offsets
from .record import Index

__all__ = ["merged_parts"]


def merged_parts(parts: Sequence[Index], *, name: str, excluded_limit: int = 10_000,
                 path: str | None = None) -> Iterator[bytes | memoryview]:
    """The bytes of the index of ``parts``' shards, in part order, without holding it.

    Each part is an index of consecutive shards; the result is byte-identical to
    ``serialize`` of one build of all the shards (buckets and extensions re-numbered in
    the canonical tables, rows grouped by bucket, then part, then row). Memory: the
    tables and one slice of one part at a time.

    Args:
        parts: the part indexes, in shard order.
        name: the merged index's dataset name.
        excluded_limit: excluded samples listed at most (the count stays exact).
        path: where the bytes go (shard URLs beside or below it are stored relative).

    Raises:
        IndexFormatError: the parts were bucketed differently, use more than 64
            distinct member extensions together, or record different costs.
    """
    if not parts:
        raise IndexFormatError("nothing to merge: no index parts given")
    bucket_by = dict(parts[0].bucket_by)
    for p in parts[1:]:
        if dict(p.bucket_by) != bucket_by:
            raise IndexFormatError(f"index parts were bucketed differently: {bucket_by} and {dict(p.bucket_by)}; "
                                   "build every part with the same --bucket-by")
    buckets = sorted({b for p in parts for b in p.buckets}, key=bucket_order)
    exts = sorted({e for p in parts for e in p.exts})
    if len(exts) > 64:
        raise IndexFormatError(f"index parts use {len(exts)} distinct member extensions together; at most 64")
    ebit = {e: i for i, e in enumerate(exts)}
    shards = [s for p in parts for s in p.shards]
    shard_base = np.cumsum([0] + [len(p.shards) for p in parts])
    n = sum(len(p) for p in parts)
    key_total = sum(int(p.arrays["key_offsets"][-1]) for p in parts)
    max_offset = max((int(p.offset.max()) for p in parts if len(p)), default=0)
    max_length = max((int(p.length.max()) for p in parts if len(p)), default=0)
    # per part: its bucket-table index of each global bucket (or -1)
    local = []
    for p in parts:  # a dict per part: O(buckets) each, not O(buckets^2)
        pos = {b: i for i, b in enumerate(p.buckets)}
        local.append(np.asarray([pos.get(b, -1) for b in buckets], dtype=np.int64))
    counts = np.zeros(len(buckets), dtype=np.int64)
    for p, loc in zip(parts, local):
        has = loc >= 0
        counts[has] += np.diff(p.bucket_offsets)[loc[has]]
    bounds = np.zeros(len(buckets) + 1, dtype=np.int64)
    np.cumsum(counts, out=bounds[1:])

    # (part number, lo, hi) of every non-empty slice, in merged row order, bucket by
    # bucket: computed once (bucket offsets only), walked once per section
    per_bucket: list[list[tuple[int, int, int]]] = []
    offsets = [p.bucket_offsets.tolist() for p in parts]
    local_lists = [loc.tolist() for loc in local]
    for b in range(len(buckets)):
        per_bucket.append([])
        for j in range(len(parts)):
            lb = local_lists[j][b]
            if lb >= 0 and offsets[j][lb + 1] > offsets[j][lb]:
                per_bucket[-1].append((j, offsets[j][lb], offsets[j][lb + 1]))
    order = [t for slices_b in per_bucket for t in slices_b]

    def slices() -> Iterator[tuple[int, Index, int, int]]:  # (part number, part, lo, hi) in merged row order
        for j, lo, hi in order:
            yield j, parts[j], lo, hi

    remaps = [np.asarray([ebit[e] for e in p.exts], dtype=np.uint64) for p in parts]

    def column(k: str) -> Iterator[np.ndarray]:
        for j, p, lo, hi in slices():
            v = p.arrays[k][lo:hi]
            if k == "shard":
                v = v.astype(np.int64) + int(shard_base[j])
            elif k == "exts":
                v = _remap_bits(v.astype(np.uint64), remaps[j])
            yield v

    def key_offsets() -> Iterator[np.ndarray]:
        yield np.zeros(1, np.int64)
        base = 0
        for _, p, lo, hi in slices():
            ko = p.arrays["key_offsets"][lo : hi + 1].astype(np.int64)
            yield ko[1:] - ko[0] + base
            base += int(ko[-1] - ko[0])

    def key_bytes() -> Iterator[np.ndarray]:
        for _, p, lo, hi in slices():
            ko = p.arrays["key_offsets"]
            yield p.arrays["keys"][int(ko[lo]) : int(ko[hi])]

    producers: dict[str, Callable[[], Iterable[Any]]] = {
        "bucket_offsets": lambda: [bounds], "key_offsets": key_offsets, "keys": key_bytes,
        **{k: (lambda k=k: column(k)) for k in ROW_ARRAYS},
    }
    samples_ex = [e for p in parts for e in p.excluded.get("samples", [])]
    excluded: dict[str, Any] = {"samples": samples_ex[:excluded_limit],
                                "shards": [f for p in parts for f in p.excluded.get("shards", [])],
                                "count": sum(int(p.excluded.get("count", 0)) for p in parts)}
    if len(samples_ex) > excluded_limit or any(p.excluded.get("truncated") for p in parts):
        excluded["truncated"] = True
    members = _merged_members(parts, slices, remaps, producers)
    cost = _merged_costs(parts, per_bucket, counts, producers)
    yield from columns_parts(name, shards, buckets, bucket_by, exts, excluded, producers, samples=n,
                             key_bytes=key_total, max_offset=max_offset, max_length=max_length, cost=cost,
                             path=path, **members)


def _merged_costs(parts: Sequence[Index], per_bucket: Sequence[Sequence[tuple[int, int, int]]], counts: np.ndarray,
                  producers: dict[str, Callable[[], Iterable[Any]]]) -> tuple[str, np.dtype, np.dtype] | None:
    """merged_parts' cost producers (added to ``producers``) and (kind, cost dtype,
    order dtype), or None if no part has costs.

    Raises:
        IndexFormatError: some parts have costs and others none, or of another kind.
    """
    kinds = {p.cost_kind for p in parts}
    if kinds == {None}:
        return None
    if len(kinds) > 1:
        raise IndexFormatError(f"index parts record different costs ({sorted(map(str, kinds))}); build every part "
                               "with the same --cost")
    costs = [p.cost for p in parts]
    integral = all(c.dtype.kind in "iu" for c in costs if c is not None and c.size)  # type: ignore[union-attr]
    top = max((c.max() for c in costs if c is not None and c.size), default=0)  # type: ignore[union-attr]

    def cost_column() -> Iterator[np.ndarray]:
        for slices_b in per_bucket:
            for j, lo, hi in slices_b:
                yield costs[j][lo:hi]  # type: ignore[index]

    def cost_order() -> Iterator[np.ndarray]:
        for slices_b in per_bucket:  # each part's slice of the bucket is a run sorted by cost
            if not slices_b:
                continue
            values, rows, base = [], [], 0
            for j, lo, hi in slices_b:
                local = parts[j].arrays["cost_order"][lo:hi].astype(np.int64)
                values.append(costs[j][lo + local])  # type: ignore[index]
                rows.append(local + base)
                base += hi - lo
            yield np.concatenate(rows)[np.argsort(np.concatenate(values), kind="stable")]

    producers.update(cost=cost_column, cost_order=cost_order)
    return (next(iter(kinds)), cost_dtype(integral, top),  # type: ignore[return-value]
            narrowest_int(max(int(counts.max()) - 1, 0) if counts.size else 0))


def _merged_members(parts: Sequence[Index], slices: Callable[[], Iterator[tuple[int, Index, int, int]]],
                    remaps: Sequence[np.ndarray], producers: dict[str, Callable[[], Iterable[Any]]]) -> dict[str, Any]:
    """merged_parts' member-table producers (added to ``producers``) and sizes: none if no
    part has a member table; a part without one records no members for its samples."""
    if not any(p.has_members for p in parts):
        return {}

    def member_start() -> Iterator[np.ndarray]:
        yield np.zeros(1, np.int64)
        base = 0
        for _, p, lo, hi in slices():
            if not p.has_members:
                yield np.full(hi - lo, base, np.int64)
                continue
            ms = p.arrays["member_start"][lo : hi + 1].astype(np.int64)
            yield ms[1:] - ms[0] + base
            base += int(ms[-1] - ms[0])

    def member_column(k: str) -> Iterator[np.ndarray]:
        for j, p, lo, hi in slices():
            if p.has_members:
                ms = p.arrays["member_start"]
                a, b = int(ms[lo]), int(ms[hi])
                if k == "member_offset" and k not in p.arrays:  # a part from before member_offset
                    yield plain_offsets(p.arrays["member_size"][a:b], np.diff(ms[lo : hi + 1]))
                    continue
                v = p.arrays[k][a:b]
                yield remaps[j].astype(np.uint8)[v] if k == "member_ext" else v

    producers.update(member_start=member_start, member_ext=lambda: member_column("member_ext"),
                     member_size=lambda: member_column("member_size"),
                     member_offset=lambda: member_column("member_offset"))
    with_members = [p for p in parts if p.has_members and p.arrays["member_size"].size]
    return {"members": sum(int(p.arrays["member_start"][-1]) for p in parts if p.has_members),
            "max_member_size": max((int(p.arrays["member_size"].max()) for p in with_members), default=0),
            "max_member_offset": max((int(np.max(p.arrays["member_offset"] if "member_offset" in p.arrays else
                                             plain_offsets(p.arrays["member_size"], np.diff(p.arrays["member_start"]))))
                                      for p in with_members), default=0)}


def _remap_bits(mask: np.ndarray, bit: np.ndarray) -> np.ndarray:
    """Masks with bit i moved to bit ``bit[i]`` (one pass per bit, numpy only)."""
    if np.array_equal(bit, np.arange(bit.size, dtype=np.uint64)):
        return mask
    out = np.zeros_like(mask)
    for i, to in enumerate(bit.tolist()):
        out |= ((mask >> np.uint64(i)) & np.uint64(1)) << np.uint64(to)
    return out
