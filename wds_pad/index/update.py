"""Updating an index: the previous index, the bucket function it was built with, and the
rows of its unchanged shards.

``build_index(..., update=...)`` and ``build_index_distributed`` read the previous index
with :func:`previous_index`, take the rows of every shard whose size and change stamp
are unchanged from it (:func:`reusable_rows`) and scan only the others, and the shards
named to be rescanned (``rescan=``, ``--rescan``: rewritten in place, size and stamp
kept, as ``verify --deep`` finds them); ``wds-pad index --update`` without
``--bucket-by`` buckets as the index was bucketed (:func:`bucket_fn_of`).

Invariants:
- an update is refused when the previous index was bucketed otherwise than the
  function given, or recorded another cost (or none, or costs where none are asked
  for): a ConfigError naming both, whose fix is a full rebuild; reused rows keep their
  costs, rescanned ones get new ones;
- a reused shard's rows are the ones a scan would give (byte order, the member table,
  its excluded samples): the updated index is the one a full build gives; a shard whose
  member table misses a sample, or one named in ``rescan``, is rescanned instead;
- a bucketing that cannot be rebuilt from its description (a Python callable) reuses
  rows and refuses any shard to scan.
"""

from __future__ import annotations

from typing import Any, Collection, Hashable, Iterable, Mapping, Sequence

import numpy as np

from ..errors import ConfigError, ShardError
from ..io.redact import redact
from ..io.urls import expand_urls
from .buckets.builtin import SingleBucket
from .buckets.cost import CostFn, parse_cost
from .buckets.protocol import BucketFn
from .codec import load_index
from .layout import cost_values
from .record import Index
from .rows import ShardRows
from .shardfile import Stat, shard_info

__all__ = ["bucket_fn_of", "cost_fn_of", "previous_index", "reusable_rows", "update_and_rescan"]


def previous_index(update: Index | str | None, fn: BucketFn, storage_options: Mapping[str, Any] | None,
                   cost: CostFn | None = None) -> Index | None:
    """The index an update reuses rows from, refused if it was bucketed otherwise than ``fn`` or recorded another cost than
    ``cost`` (its rows' costs could not be reused)."""
    previous = load_index(update, storage_options=storage_options) if isinstance(update, str) else update
    if previous is not None and dict(previous.bucket_by) != dict(fn.describe()):
        raise ConfigError(
            f"--update: the previous index was bucketed by {dict(previous.bucket_by)}, now by "
            f"{fn.describe()}; rebuild without --update to change how buckets are computed"
        )
    kind = cost.describe() if cost is not None else None
    if previous is not None and previous.cost_kind != kind:
        was = f"recorded costs {previous.cost_kind!r}" if previous.cost_kind else "recorded no costs"
        now = f"--cost {kind}" if kind else "no --cost (Python: cost=None)"
        raise ConfigError(
            f"--update: the previous index {was}, this update asks for {now}; rebuild without --update to "
            "change what costs are recorded (every shard is scanned again)"
        )
    return previous


def cost_fn_of(index: Index) -> CostFn | None:
    """The cost function ``index`` recorded its costs with (None: it has none)."""
    return parse_cost(index.cost_kind) if index.cost_kind is not None else None


class _ReuseOnly:
    """An index's bucketing that cannot be rebuilt from its description (a Python
    callable): enough to reuse its rows, refused for any shard to scan."""

    members: tuple[str, ...] = ()
    head_bytes: int | None = None
    reuse_only = True

    def __init__(self, described: Mapping[str, Any]) -> None:
        self._described = dict(described)

    def __call__(self, key: str, data: Mapping[str, bytes]) -> Hashable | None:  # pragma: no cover - refused before
        raise ConfigError(f"bucket function {self._described} cannot be rebuilt")

    def describe(self) -> dict[str, Any]:
        return dict(self._described)


def bucket_fn_of(index: Index) -> BucketFn:
    """The bucket function ``index`` was built with, rebuilt from its ``bucket_by``.

    Built-in bucketings (none, aspect, json, image, map files) come back as they were;
    a Python callable (or a map given as a mapping) cannot be rebuilt: the result then
    only lets an update reuse rows, and refuses to scan a changed or new shard.
    """
    from .buckets.builtin import AspectBuckets, ImageBuckets, JsonField
    from .buckets.user import MappingBuckets

    d = dict(index.bucket_by)
    kind = d.get("kind")
    fn: Any = None
    try:
        if kind == "none":
            fn = SingleBucket()
        elif kind == "aspect":
            fn = AspectBuckets(d["width_field"], d["height_field"], ratios=d.get("ratios"), step=d.get("step"),
                               member=d.get("member", "json"))
        elif kind == "json":
            fn = JsonField(d["field"], boundaries=d.get("boundaries"), member=d.get("member", "json"))
        elif kind == "image":
            fn = ImageBuckets(exts=tuple(d["exts"]), head_bytes=d.get("head_bytes"), ratios=d.get("ratios"),
                              step=d.get("step"))
        elif kind == "map" and d.get("source"):
            fn = MappingBuckets(d["source"])
    except (KeyError, TypeError, ConfigError):
        fn = None
    if fn is None or dict(fn.describe()) != d:
        return _ReuseOnly(d)  # type: ignore[return-value]
    return fn  # type: ignore[no-any-return]


def reusable_rows(previous: Index, urls: Sequence[str], storage_options: Mapping[str, Any] | None,
                  stats: Mapping[str, Stat] | None = None, rescan: Collection[str] = ()) -> dict[str, ShardRows]:
    """The rows of ``previous`` for each of ``urls`` whose size and change stamp are
    unchanged (``stats``: shards' known (size, stamp, is a directory), not asked for
    again), in byte order, with their member table and excluded samples; none for the
    shards in ``rescan``."""
    by_url = {s.url: i for i, s in enumerate(previous.shards) if s.error is None}
    out: dict[str, ShardRows] = {}
    candidates = [u for u in urls if u in by_url and u not in rescan]
    if not candidates:
        return out
    # each shard's rows in byte order (the index groups rows by bucket): one sort for all
    order = np.lexsort((previous.offset, previous.shard))
    bounds = np.searchsorted(previous.shard[order], np.arange(len(previous.shards) + 1))
    samples = previous.excluded.get("samples", [])
    for url in candidates:
        si = by_url[url]
        old = previous.shards[si]
        known = stats.get(url) if stats is not None else None
        try:
            size, stamp = known[:2] if known is not None else shard_info(url, storage_options)
        except ShardError:
            continue  # let the scan report it
        if size != old.size or stamp != old.stamp:
            continue
        rows = ShardRows(old, nbytes=0)
        ids = order[bounds[si] : bounds[si + 1]]
        rows.offset, rows.length = previous.offset[ids], previous.length[ids]
        rows.keys = [previous.key(int(i)) for i in ids]
        rows.buckets = [previous.buckets[int(b)] for b in previous.bucket[ids]]
        rows.exts, rows.mask = list(previous.exts), previous.arrays["exts"][ids]
        if previous.cost is not None:
            rows.cost = cost_values(previous.cost[ids])
        if previous.has_members:  # the member table, in the same byte order
            ms = previous.arrays["member_start"]
            starts, ends = ms[ids].astype(np.int64), ms[ids + 1].astype(np.int64)
            rows.member_count = ends - starts
            if not rows.member_count.all():
                continue  # written before every header form was recorded: rescan it for the fast path
            at = np.repeat(starts - np.cumsum(rows.member_count) + rows.member_count, rows.member_count) \
                + np.arange(int(rows.member_count.sum()), dtype=np.int64)
            rows.member_ext, rows.member_size = previous.arrays["member_ext"][at], previous.arrays["member_size"][at]
            rows.member_offset = previous.member_offsets(at, rows.member_count)
        rows.excluded = [e for e in samples if e.get("url") == url]
        out[url] = rows
    return out


def update_and_rescan(update: Index | str | bool | None, rescan: str | Iterable[str] | None, output: str | None,
                       shard_urls: Sequence[str],
                       storage_options: Mapping[str, Any] | None) -> tuple[Index | str | None, frozenset[str]]:
    """``update`` resolved (``True``: the index at ``output``) and the shards to rescan,
    checked: ``rescan`` needs an update and names shards being indexed."""
    if update is True:
        if output is None:
            raise ConfigError("update=True updates the index at output, but no output is given; pass "
                              "update=PATH (or an Index), or output=PATH")
        update = output
    elif update is False:
        update = None
    if rescan is None:
        return update, frozenset()
    if update is None:
        raise ConfigError("rescan= names shards to scan again in an update; without update= every shard is "
                          "scanned anyway (wds-pad index: --rescan needs --update)")
    again = expand_urls(rescan, storage_options)
    known = set(shard_urls)
    unknown = [u for u in again if u not in known]
    if unknown:
        raise ConfigError(f"shard {redact(unknown[0])!r} to rescan (--rescan) is not one of the "
                          f"{len(shard_urls)} shards being indexed (the first: {redact(shard_urls[0])!r}); name "
                          "each as the index lists it (`wds-pad verify INDEX --deep` prints them)")
    return update, frozenset(again)
