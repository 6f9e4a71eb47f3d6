"""The index as a record: per sample its shard, byte range, key and extensions, grouped by bucket.

:class:`Index` holds the sections of one index file as arrays (views of the mapped file
when loaded, :mod:`.codec`), with its shard table (:class:`ShardInfo`), bucket and
extension tables, and its content digest; it answers what the planner and the streams
ask (a bucket's sample ids, a sample's URL, key, byte range and members) and becomes a
planner ``Dataset`` in O(buckets) (:meth:`Index.to_dataset`). Rows are assembled into one
in :mod:`.rows` (``make_index``).

Invariants:
- rows are grouped by bucket, in the canonical bucket order: bucket ``b`` holds the
  sample ids ``bucket_offsets[b]:bucket_offsets[b + 1]``, and planning reads nothing per
  sample;
- an Index is checked whole at construction: every section present, one row per sample,
  the key and member tables' sizes, bucket offsets covering the rows; a damaged one
  raises :class:`IndexFormatError` naming the index;
- its digest is the file's content digest (:func:`.layout.content_digest`): a loaded
  index keeps the one stored, a built one computes it over the shard table as a file at
  its ``path`` stores it (URLs beside or below relative, :mod:`.location`), so a build
  written to ``path`` and that file loaded have one digest, wherever the folder moves;
- ``shards`` and ``urls`` are absolute, relocated URLs, what every reader of shards
  uses; ``stored_urls`` are the URLs as the file holds them (the shard-level stream's
  identity, unchanged by a move or a relocation);
- the optional costs come whole: ``cost`` and ``cost_order`` of one row per sample and
  the header's ``cost_kind``, or none of them; ``cost_order(start, stop)`` of a bucket's
  row range gives its rows cheapest first, and the k-th of them in O(1).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Mapping, Sequence

import numpy as np

from ..core.dataset import Dataset, IdRange
from ..errors import ConfigError, IndexFormatError
from ..tar.members import key_text
from .layout import (ARRAYS, COST_ARRAYS, LEGACY_MEMBER_ARRAYS, MEMBER_ARRAYS, ROW_ARRAYS, content_digest, file_header,
                     json_sections, plain_offsets, stored_urls)
from .location import Relocation, index_folder

__all__ = ["Index", "ShardInfo"]


@dataclass(frozen=True)
class ShardInfo:
    """One shard of the index: where it is, how big, its change stamp, its samples.

    ``content`` is the identity of its bytes where the scan read them all (a remote shard
    streams through the scan): ``"blake2b=<hex>"`` of the whole object; ``""`` where the
    scan read headers only. An index without it stores no such key, so its file and
    digest are those of an index written before the field existed.
    """

    url: str
    size: int
    stamp: str
    samples: int
    error: str | None = None  # set when the shard was skipped (on_error="skip")
    content: str = ""

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"url": self.url, "size": self.size, "stamp": self.stamp,
                               "samples": self.samples, "error": self.error}
        if self.content:
            out["content"] = self.content
        return out


class Index:
    """A loaded (or freshly built) index. Sample ids are row numbers ``0..len-1``.

    Rows are grouped by bucket: bucket ``b`` (``buckets[b]``) holds the sample ids
    ``bucket_offsets[b]:bucket_offsets[b + 1]``. ``shards`` and ``excluded`` may be given
    as zero-argument callables, parsed on first use; ``json_bytes`` are their sections'
    bytes as stored (a loaded index: its digest is computed over them, with
    ``relative``, the header's flag of URLs stored relative to the file). ``shards`` are
    absolute URLs (a loaded index's resolved against its ``path`` and moved by
    ``relocate``, :mod:`.location`). ``cost_kind`` names the optional ``cost`` section.
    """

    def __init__(self, shards: Sequence[ShardInfo] | Callable[[], Sequence[ShardInfo]],
                 buckets: Sequence[Hashable], arrays: Mapping[str, np.ndarray], bucket_by: Mapping[str, Any],
                 exts: Sequence[str] = (), excluded: Mapping[str, Any] | Callable[[], Mapping[str, Any]] | None = None,
                 name: str = "index", path: str | None = None, digest: str = "",
                 json_bytes: Mapping[str, Any] | None = None, *, cost_kind: str | None = None,
                 relocate: Relocation = (), relative: bool = False) -> None:
        self._shards = shards if callable(shards) else tuple(shards)
        self._excluded = excluded if callable(excluded) else dict(excluded or {})
        self.buckets = tuple(buckets)
        self.arrays = dict(arrays)
        self.bucket_by = dict(bucket_by)
        self.exts = tuple(exts)
        self.name, self.path = name, path
        self.cost_kind = cost_kind
        self.relocate = tuple(relocate)
        self._json_bytes = dict(json_bytes) if json_bytes is not None else None
        self._relative = bool(relative)
        where = path or name
        missing = [k for k in ARRAYS if k not in self.arrays]
        if missing:
            raise IndexFormatError(f"index {where!r} lacks array(s) {missing}")
        n = self.arrays["shard"].size
        for k in ROW_ARRAYS:
            if self.arrays[k].size != n:
                raise IndexFormatError(
                    f"index {where!r} is damaged: array {k!r} has {self.arrays[k].size} rows, expected {n}; "
                    "rebuild it with `wds-pad index`"
                )
        if self.arrays["key_offsets"].size != n + 1:
            raise IndexFormatError(f"index {where!r} is damaged: key table size")
        present = tuple(k for k in MEMBER_ARRAYS if k in self.arrays)
        if present and (present not in (MEMBER_ARRAYS, LEGACY_MEMBER_ARRAYS)
                        or self.arrays["member_start"].size != n + 1
                        or any(self.arrays[k].size != int(self.arrays["member_start"][-1]) for k in present[1:])):
            raise IndexFormatError(f"index {where!r} is damaged: member table sizes; rebuild it with `wds-pad index`")
        bo = self.arrays["bucket_offsets"]
        if bo.size != len(self.buckets) + 1 or int(bo[0]) != 0 or int(bo[-1]) != n:
            raise IndexFormatError(f"index {where!r} is damaged: bucket offsets do not cover its {n} rows; "
                                   "rebuild it with `wds-pad index`")
        costs = [k for k in COST_ARRAYS if k in self.arrays]
        if costs and (len(costs) != len(COST_ARRAYS) or cost_kind is None
                      or any(self.arrays[k].size != n for k in COST_ARRAYS)):
            raise IndexFormatError(f"index {where!r} is damaged: its cost sections or cost kind are incomplete; "
                                   "rebuild it with `wds-pad index --cost ...`")
        if cost_kind is not None and not costs:
            raise IndexFormatError(f"index {where!r} is damaged: it names a cost ({cost_kind!r}) but has no cost "
                                   "section; rebuild it with `wds-pad index --cost ...`")
        self.digest = digest or self.compute_digest()

    # -- lazily parsed sections -----------------------------------------------------------
    @property
    def shards(self) -> tuple[ShardInfo, ...]:
        if callable(self._shards):
            self._shards = tuple(self._shards())
        return self._shards  # type: ignore[return-value]

    @property
    def excluded(self) -> dict[str, Any]:
        if callable(self._excluded):
            self._excluded = dict(self._excluded())
        return self._excluded  # type: ignore[return-value]

    def __getstate__(self) -> dict[str, Any]:
        """A copy for another process (a spawned DataLoader worker, a remote index): the
        lazily parsed sections parsed now, the stored section bytes copied out of the buffer."""
        state = dict(self.__dict__)
        state["_shards"], state["_excluded"] = self.shards, self.excluded
        if self._json_bytes is not None:
            state["_json_bytes"] = {k: bytes(v) for k, v in self._json_bytes.items()}
        return state

    # -- sizes and lookups -------------------------------------------------------------
    def __len__(self) -> int:
        return int(self.arrays["shard"].size)

    @property
    def shard(self) -> np.ndarray:
        return self.arrays["shard"]

    @property
    def offset(self) -> np.ndarray:
        return self.arrays["offset"]

    @property
    def length(self) -> np.ndarray:
        return self.arrays["length"]

    @property
    def bucket_offsets(self) -> np.ndarray:
        return self.arrays["bucket_offsets"]

    @property
    def bucket(self) -> np.ndarray:
        """Each sample's bucket-table index (derived from the bucket offsets on first use)."""
        cached = self.__dict__.get("_bucket")
        if cached is None:
            dt = np.int16 if len(self.buckets) < 2**15 else np.int32
            cached = np.repeat(np.arange(len(self.buckets), dtype=dt), np.diff(self.bucket_offsets))
            cached.flags.writeable = False
            self.__dict__["_bucket"] = cached
        return cached

    def bucket_of(self, i: int) -> int:
        """The bucket-table index of sample ``i`` (one binary search, nothing materialised)."""
        return int(np.searchsorted(self.bucket_offsets, int(i), side="right")) - 1

    @property
    def folder(self) -> str | None:
        """The folder the index file lies in (a URL prefix ending in ``/``), or None."""
        return index_folder(self.path)

    @property
    def stored_urls(self) -> tuple[str, ...]:
        """The shard URLs as the file stores them (relative to :attr:`folder` where the
        shards sit beside or below it): what identifies a shard across a move."""
        if self._json_bytes is not None:
            return tuple(s["url"] for s in json.loads(bytes(self._json_bytes["shards"])))
        return tuple(stored_urls(list(self.urls), self.folder)[0])

    @property
    def samples_identity(self) -> tuple[str, tuple[str, ...]]:
        """What makes two indexes the same samples: the content digest and the resolved
        shard URLs (a copy of the file is the same samples; the same stored URLs
        resolved elsewhere are not). Planning two such indexes reads every sample twice."""
        return self.digest, self.urls

    @property
    def urls(self) -> tuple[str, ...]:
        shards = self.shards
        cached = self.__dict__.get("_urls")
        if cached is None or cached[0] is not shards:  # built once per shard table (hot paths read it per batch)
            cached = self.__dict__["_urls"] = (shards, tuple(s.url for s in shards))
        return cached[1]

    def key(self, i: int) -> str:
        """The webdataset ``__key__`` of sample ``i`` (a name's undecodable bytes as the
        surrogate escapes webdataset gives, ``tar.members.key_text``)."""
        ko = self.arrays["key_offsets"]
        return key_text(self.arrays["keys"][int(ko[i]) : int(ko[i + 1])])

    def url(self, i: int) -> str:
        return self.shards[int(self.arrays["shard"][i])].url

    def sample_exts(self, i: int) -> tuple[str, ...]:
        mask = int(self.arrays["exts"][i])
        return tuple(e for b, e in enumerate(self.exts) if mask >> b & 1)

    def describe_samples(self, ids: Sequence[int] | np.ndarray) -> tuple[list[str], list[str]]:
        """Shard URLs and webdataset keys of ``ids``, parallel lists."""
        return [self.url(int(i)) for i in ids], [self.key(int(i)) for i in ids]

    def bucket_counts(self) -> dict[Hashable, int]:
        counts = np.diff(self.bucket_offsets)
        return {k: int(c) for k, c in zip(self.buckets, counts)}

    def bucket_bytes(self) -> dict[Hashable, int]:
        total = np.zeros(len(self) + 1, dtype=np.int64)
        np.cumsum(self.length, out=total[1:])
        bo = self.bucket_offsets
        return {k: int(total[bo[b + 1]] - total[bo[b]]) for b, k in enumerate(self.buckets)}

    def bucket_samples(self) -> dict[Hashable, np.ndarray]:
        """Bucket key -> sorted sample ids (materialised; ``to_dataset`` needs none of them)."""
        bo = self.bucket_offsets.tolist()
        return {k: np.arange(bo[b], bo[b + 1], dtype=np.int64) for b, k in enumerate(self.buckets)}

    def to_dataset(self, name: str | None = None, repeats: int = 0, weight: float = 1.0,
                   costs: bool = False) -> Dataset:
        """This index as one planner Dataset (its buckets, these repeats and weight; with
        ``costs``, each sample's cost and each bucket's cost order, what a budget plans by).

        O(buckets): each bucket is the ``IdRange`` of its rows; no sample is read (the cost
        order is read at the ranks the planner asks for).

        Raises:
            ConfigError: ``costs`` for an index built without ``--cost``.
        """
        bo = self.bucket_offsets.tolist()
        buckets = {k: IdRange(bo[b], bo[b + 1]) for b, k in enumerate(self.buckets)}
        if not costs:
            return Dataset(name=name or self.name, buckets=buckets, repeats=repeats, weight=weight)
        if self.cost is None:
            raise ConfigError(
                f"index {self.path or self.name!r} records no costs, so it cannot be planned under a budget: "
                "build it with --cost (build_index(..., cost='json:FIELD' | 'image:pixels' | 'bytes')), or give "
                "an int batch_size")
        rows = {k: (bo[b], bo[b + 1]) for b, k in enumerate(self.buckets)}
        return Dataset(name=name or self.name, buckets=buckets, repeats=repeats, weight=weight, cost=self.cost,
                       cost_order=lambda key: _ByCost(self, *rows[key]))

    # -- costs ---------------------------------------------------------------------------
    @property
    def cost(self) -> np.ndarray | None:
        """Each sample's cost (``cost_kind`` says of what), memory-mapped when loaded; None
        for an index built without ``--cost``."""
        return self.arrays.get("cost")

    def cost_order(self, start: int, stop: int, k: int | Sequence[int] | np.ndarray | None = None) -> np.ndarray:
        """The rows of one bucket, cheapest first (equal costs by row id), as int64 ids.

        Args:
            start, stop: the bucket's row range, ``bucket_offsets[b]`` and
                ``bucket_offsets[b + 1]`` (rows of a bucket are contiguous).
            k: only these ranks (0: the cheapest): the k-th cheapest row in O(1) each,
                nothing sorted or materialised beyond them.

        Raises:
            IndexFormatError: the index has no costs.
            ConfigError: ``start, stop`` is not one bucket's row range, or a rank is out
                of it.
        """
        if "cost_order" not in self.arrays:
            raise IndexFormatError(f"index {self.path or self.name!r} has no costs; build it with "
                                   "`wds-pad index ... --cost json:FIELD|image:pixels|bytes`")
        bo = self.bucket_offsets
        b = int(np.searchsorted(bo[:-1], int(start), side="right")) - 1  # the last bucket starting there
        if int(start) == int(stop) and 0 <= b and int(bo[b]) == int(start):
            b = int(np.searchsorted(bo[:-1], int(start), side="left"))  # an empty bucket starts there too
        if not (0 <= b < len(self.buckets) and int(bo[b]) == int(start) and int(bo[b + 1]) == int(stop)):
            raise ConfigError(f"cost_order({start}, {stop}): not the row range of one bucket; bucket b holds rows "
                              "bucket_offsets[b] to bucket_offsets[b + 1]")
        order = self.arrays["cost_order"]
        if k is None:
            return order[start:stop].astype(np.int64) + int(start)
        at = np.asarray(k, dtype=np.int64)
        if at.size and (int(at.min()) < 0 or int(at.max()) >= int(stop) - int(start)):
            raise ConfigError(f"cost_order: rank out of range for a bucket of {int(stop) - int(start)} rows")
        return order[int(start) + at].astype(np.int64) + int(start)

    @property
    def has_members(self) -> bool:
        """Whether the index records its samples' members (the member table sections)."""
        return "member_start" in self.arrays

    def numeric_sections(self) -> tuple[str, ...]:
        """The numeric sections this index holds, in file order."""
        return ARRAYS + tuple(k for k in MEMBER_ARRAYS + COST_ARRAYS if k in self.arrays)

    def member_offsets(self, at: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """Payload offsets (from their sample's first byte) of the member rows ``at``:
        whole samples' members, ``counts`` per sample, back to back (int64)."""
        if "member_offset" in self.arrays:
            return self.arrays["member_offset"][at].astype(np.int64)
        return plain_offsets(self.arrays["member_size"][at], counts)  # a file from before member_offset

    def members_missing(self) -> tuple[int, str]:
        """How many samples have no member table (they stream through the parse path),
        and why, as advice."""
        n = len(self)
        if not self.has_members:
            return n, ("the index has no member table (converted from format version 1, or made by "
                       "tools/make_index.py without members); rebuild it with `wds-pad index` to read "
                       "every sample without parsing its headers")
        missing = int(np.count_nonzero(np.diff(self.arrays["member_start"]) == 0)) if n else 0
        if not missing:
            return 0, ""
        return missing, ("the index was written before every header form was recorded (those samples "
                         "have pax, GNU long-name or ustar-prefix headers); `wds-pad index --update` "
                         "rescans their shards")

    # -- digest --------------------------------------------------------------------------
    def compute_digest(self) -> str:
        return content_digest(self.buckets, self.exts, self.json_blobs(),
                              ((k, self.arrays[k].dtype, [self.arrays[k]]) for k in self.numeric_sections()),
                              cost=self.cost_kind, relative=self.relative)

    def json_blobs(self) -> dict[str, bytes]:
        """The JSON sections' bytes: as stored when loaded, else as a file at ``path``
        will store them."""
        raw = self._json_bytes
        return dict(raw) if raw is not None else json_sections(self.shards, self.excluded, self.folder)

    @property
    def relative(self) -> bool:
        """Whether the file stores some shard URL relative to its folder."""
        if self._json_bytes is not None:
            return self._relative
        return stored_urls(list(self.urls), self.folder)[1]

    def header(self) -> dict[str, Any]:
        return file_header(self.name, len(self), self.buckets, self.bucket_by, self.exts, self.digest,
                           cost=self.cost_kind, relative=self.relative)

    def located(self, path: str) -> "Index":
        """This index as written at ``path``: its absolute (relocated) shard URLs stored
        relative to ``path``'s folder where they sit beside or below it, the digest of
        that file. The same object if it already is that file."""
        if path == self.path and not self.relocate:
            return self
        return Index(shards=self.shards, buckets=self.buckets, arrays=self.arrays, bucket_by=self.bucket_by,
                     exts=self.exts, excluded=self.excluded, name=self.name, path=path, cost_kind=self.cost_kind)

    def bytes_per_sample(self) -> dict[str, float]:
        """On-disk bytes per sample of each section (and ``total``)."""
        n = max(len(self), 1)
        out = {k: self.arrays[k].nbytes / n for k in self.numeric_sections()}
        out["shards+excluded"] = sum(len(b) for b in self.json_blobs().values()) / n
        out["total"] = sum(out.values())
        return out


class _ByCost:
    """One bucket's rows in cost order, read at the ranks asked for (``order[k]``)."""

    __slots__ = ("index", "start", "stop")

    def __init__(self, index: Index, start: int, stop: int) -> None:
        self.index, self.start, self.stop = index, start, stop

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, k: Any) -> np.ndarray:
        return self.index.cost_order(self.start, self.stop, k)
