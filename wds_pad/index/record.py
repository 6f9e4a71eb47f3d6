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
  index keeps the one stored, a built one computes it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Hashable, Mapping, Sequence

import numpy as np

from ..core.dataset import Dataset, IdRange
from ..errors import IndexFormatError
from ..tar.members import key_text
from .layout import (
    ARRAYS,
    LEGACY_MEMBER_ARRAYS,
    MEMBER_ARRAYS,
    ROW_ARRAYS,
    content_digest,
    file_header,
    json_sections,
    plain_offsets,
)

__all__ = ["Index", "ShardInfo"]


@dataclass(frozen=True)
class ShardInfo:
    """One shard of the index: where it is, how big, its change stamp, its samples."""

    url: str
    size: int
    stamp: str
    samples: int
    error: str | None = None  # set when the shard was skipped (on_error="skip")

    def to_json(self) -> dict[str, Any]:
        return {"url": self.url, "size": self.size, "stamp": self.stamp,
                "samples": self.samples, "error": self.error}


class Index:
    """A loaded (or freshly built) index. Sample ids are row numbers ``0..len-1``.

    Rows are grouped by bucket: bucket ``b`` (``buckets[b]``) holds the sample ids
    ``bucket_offsets[b]:bucket_offsets[b + 1]``. ``shards`` and ``excluded`` may be given
    as zero-argument callables, parsed on first use; ``json_bytes`` are their sections'
    bytes as stored (a loaded index: its digest is computed over them).
    """

    def __init__(self, shards: Sequence[ShardInfo] | Callable[[], Sequence[ShardInfo]],
                 buckets: Sequence[Hashable], arrays: Mapping[str, np.ndarray], bucket_by: Mapping[str, Any],
                 exts: Sequence[str] = (), excluded: Mapping[str, Any] | Callable[[], Mapping[str, Any]] | None = None,
                 name: str = "index", path: str | None = None, digest: str = "",
                 json_bytes: Mapping[str, Any] | None = None) -> None:
        self._shards = shards if callable(shards) else tuple(shards)
        self._excluded = excluded if callable(excluded) else dict(excluded or {})
        self.buckets = tuple(buckets)
        self.arrays = dict(arrays)
        self.bucket_by = dict(bucket_by)
        self.exts = tuple(exts)
        self.name, self.path = name, path
        self._json_bytes = dict(json_bytes) if json_bytes is not None else None
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

    def to_dataset(self, name: str | None = None, repeats: int = 0, weight: float = 1.0) -> Dataset:
        """This index as one planner Dataset (its buckets, these repeats and weight).

        O(buckets): each bucket is the ``IdRange`` of its rows; no sample is read.
        """
        bo = self.bucket_offsets.tolist()
        return Dataset(name=name or self.name, buckets={k: IdRange(bo[b], bo[b + 1]) for b, k in enumerate(self.buckets)},
                       repeats=repeats, weight=weight)

    @property
    def has_members(self) -> bool:
        """Whether the index records its samples' members (the member table sections)."""
        return "member_start" in self.arrays

    def numeric_sections(self) -> tuple[str, ...]:
        """The numeric sections this index holds, in file order."""
        return ARRAYS + tuple(k for k in MEMBER_ARRAYS if k in self.arrays)

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
                       ((k, self.arrays[k].dtype, [self.arrays[k]]) for k in self.numeric_sections()))

    def json_blobs(self) -> dict[str, bytes]:
        """The JSON sections' bytes: as stored when loaded, else as they will be written."""
        raw = self._json_bytes
        return dict(raw) if raw is not None else json_sections(self.shards, self.excluded)

    def header(self) -> dict[str, Any]:
        return file_header(self.name, len(self), self.buckets, self.bucket_by, self.exts, self.digest)

    def bytes_per_sample(self) -> dict[str, float]:
        """On-disk bytes per sample of each section (and ``total``)."""
        n = max(len(self), 1)
        out = {k: self.arrays[k].nbytes / n for k in self.numeric_sections()}
        out["shards+excluded"] = sum(len(b) for b in self.json_blobs().values()) / n
        out["total"] = sum(out.values())
        return out
