"""The index: per sample its shard, byte range, key and extensions, grouped by bucket, memory-mapped.

On-disk format (one file, version ``FORMAT_VERSION`` = 2)::

    b"WDSPADIX" | u32 version | u32 header crc32 | u64 header length | header JSON
    | zero padding to 64 bytes | sections, each 64-byte aligned

The JSON header is small (name, bucket table, how buckets were computed, the member
extension table, each section's dtype/offset/count and a content digest); the shard
table and the excluded samples are JSON sections of their own, parsed on first use.
Rows are **grouped by bucket** (canonical bucket order; within a bucket, shard order,
then byte order), so bucket b's sample ids are ``bucket_offsets[b]:bucket_offsets[b+1]``
and the planner needs the bucket table and its offsets alone: O(buckets).

Sections, in file order (what reads them):

- ``bucket_offsets`` int64 [buckets + 1]: the planner;
- ``shard``, ``offset``, ``length``, ``exts`` [samples]: the streaming hot path, each as
  narrow as its values allow (``shard`` int16/int32, ``offset``/``length`` int32 when
  every value is under 2 GiB, else int64, ``exts`` a uint8..uint64 bit mask);
- ``key_offsets`` [samples + 1] (int32 or int64) and ``keys`` (UTF-8 bytes): sample keys;
- optional, the member table (the streaming fast path; written by ``wds-pad index``):
  ``member_start`` [samples + 1] (int32/int64) into ``member_ext`` (uint8, an index into
  the extension table), ``member_size`` (int32/int64, payload bytes) and
  ``member_offset`` (int32/int64, the payload's offset from the sample's first byte),
  each sample's members in archive order. Every header form the parser reads is
  recorded: pax headers (per member or global), GNU long names and links, ustar
  prefixes, metadata members skipped between members. A file written before
  ``member_offset`` existed holds the other three sections and records members only
  for plain samples (each one 512-byte header right before its payload): their offsets
  follow from the sizes (:func:`plain_offsets`), and samples with no members there
  stream through the parse path until ``wds-pad index --update`` rescans their shards.
  An index without a member table (from ``tools/make_index.py`` without members, or
  converted from version 1) streams through that parse path;
- ``shards``, ``excluded``: JSON, for inspect, verify, update and the stale-shard check.

Invariants:
- ``serialize`` gives the bytes of one file, ``merged_parts`` the bytes of the merge of
  several files without holding them (the same bytes a build of all their shards in one
  process gives); ``index.output`` checks where they go and writes them atomically;
- ``load_index`` refuses a wrong magic, a damaged header (crc32), a truncated file, and
  (``verify=True``, the default for files up to 256 MiB) a wrong digest; a version-1
  file is refused with the one command that converts it (``wds-pad index --update -o
  PATH``), which reads it through ``load_index(..., convert=True)``;
- local files are memory-mapped: ranks and DataLoader workers share the pages, loading
  parses nothing per sample, and planning touches no per-sample section.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import struct
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Iterable, Iterator, Mapping, Sequence

import numpy as np

from ..core.dataset import Dataset, IdRange, bucket_order
from ..errors import IndexFormatError
from ..io.urls import local_path

__all__ = ["FORMAT_VERSION", "MAGIC", "Index", "ShardInfo", "columns_parts", "load_index", "make_index",
           "merged_parts", "serialize"]

FORMAT_VERSION = 2
MAGIC = b"WDSPADIX"
_PREFIX = struct.Struct("<8sIIQ")
_ALIGN = 64
VERIFY_LIMIT = 256 * 2**20
ROW_ARRAYS = ("shard", "offset", "length", "exts")           # one value per sample
ARRAYS = ("bucket_offsets", *ROW_ARRAYS, "key_offsets", "keys")  # the numeric sections, in file order
JSON_SECTIONS = ("shards", "excluded")
MEMBER_ARRAYS = ("member_start", "member_ext", "member_size", "member_offset")  # optional: the member table
LEGACY_MEMBER_ARRAYS = MEMBER_ARRAYS[:3]  # files written before member_offset: plain samples only
_V1_DTYPES = {"shard": np.int32, "offset": np.int64, "length": np.int64, "bucket": np.int32,
              "exts": np.uint64, "key_offsets": np.int64, "keys": np.uint8}
CONVERT_HINT = "convert it in place with `wds-pad index --update -o {path}` (nothing is rescanned)"


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


def _jsonable_key(key: Hashable) -> Any:
    return list(key) if isinstance(key, tuple) else key


def _key_from_json(value: Any) -> Hashable:
    return tuple(_key_from_json(v) for v in value) if isinstance(value, list) else value


def _signed(max_value: int, *, small: type = np.int32) -> np.dtype:
    """The narrowest of ``small``, int32, int64 holding values in [0, max_value]."""
    for dt in (small, np.int32, np.int64):
        if max_value <= np.iinfo(dt).max:
            return np.dtype(dt)
    raise IndexFormatError(f"value {max_value} does not fit an int64 index column")


def _mask_dtype(exts: int) -> np.dtype:
    for dt in (np.uint8, np.uint16, np.uint32, np.uint64):
        if exts <= np.iinfo(dt).bits:
            return np.dtype(dt)
    raise IndexFormatError(f"{exts} member extensions; the index records at most 64")


def member_dtypes(members: int, max_size: int, max_offset: int) -> dict[str, np.dtype]:
    """The dtypes of the member table's sections, from the member count, the largest
    payload and the largest payload offset within a sample."""
    return {"member_start": _signed(members), "member_ext": np.dtype(np.uint8), "member_size": _signed(max_size),
            "member_offset": _signed(max_offset)}


def plain_offsets(sizes: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Payload offsets from each sample's first byte when its members are plain: one
    512-byte header right before each payload, back to back (``sizes`` of the members,
    ``counts`` per sample, samples back to back)."""
    sizes = np.asarray(sizes, np.int64)
    counts = np.asarray(counts, np.int64)
    blocks = 512 + ((sizes + 511) & ~511)
    ends = np.cumsum(blocks)
    starts = ends - blocks  # header offsets from the first member's header
    first = np.cumsum(counts) - counts
    return starts - np.repeat(starts[first[counts > 0]], counts[counts > 0]) + 512


def column_dtypes(shards: int, max_offset: int, max_length: int, key_bytes: int, exts: int) -> dict[str, np.dtype]:
    """The dtype of each numeric section: as narrow as its values allow, chosen from the
    largest values only (so a build and a merge of the same shards choose alike)."""
    return {"bucket_offsets": np.dtype(np.int64), "shard": _signed(max(shards - 1, 0), small=np.int16),
            "offset": _signed(max_offset), "length": _signed(max_length), "exts": _mask_dtype(exts),
            "key_offsets": _signed(key_bytes), "keys": np.dtype(np.uint8)}


class Index:
    """A loaded (or freshly built) index. Sample ids are row numbers ``0..len-1``.

    Rows are grouped by bucket: bucket ``b`` (``buckets[b]``) holds the sample ids
    ``bucket_offsets[b]:bucket_offsets[b + 1]``. ``shards`` and ``excluded`` may be given
    as zero-argument callables, parsed on first use.
    """

    def __init__(self, shards: Sequence[ShardInfo] | Callable[[], Sequence[ShardInfo]],
                 buckets: Sequence[Hashable], arrays: Mapping[str, np.ndarray], bucket_by: Mapping[str, Any],
                 exts: Sequence[str] = (), excluded: Mapping[str, Any] | Callable[[], Mapping[str, Any]] | None = None,
                 name: str = "index", path: str | None = None, digest: str = "") -> None:
        self._shards = shards if callable(shards) else tuple(shards)
        self._excluded = excluded if callable(excluded) else dict(excluded or {})
        self.buckets = tuple(buckets)
        self.arrays = dict(arrays)
        self.bucket_by = dict(bucket_by)
        self.exts = tuple(exts)
        self.name, self.path = name, path
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
        self.digest = digest or self._compute_digest()

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
        """The webdataset ``__key__`` of sample ``i``."""
        ko = self.arrays["key_offsets"]
        return bytes(self.arrays["keys"][int(ko[i]) : int(ko[i + 1])]).decode("utf-8")

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
    def _compute_digest(self) -> str:
        return _digest(self.buckets, self.exts, self._blobs(),
                       ((k, self.arrays[k].dtype, [self.arrays[k]]) for k in self.numeric_sections()))

    def _blobs(self) -> dict[str, bytes]:
        """The JSON sections' bytes: as stored when loaded, else as they will be written."""
        raw = self.__dict__.get("_raw_sections")
        return dict(raw) if raw is not None else _json_sections(self)

    def header(self) -> dict[str, Any]:
        return _header(self.name, len(self), self.buckets, self.bucket_by, self.exts, self.digest)

    def bytes_per_sample(self) -> dict[str, float]:
        """On-disk bytes per sample of each section (and ``total``)."""
        n = max(len(self), 1)
        out = {k: self.arrays[k].nbytes / n for k in self.numeric_sections()}
        out["shards+excluded"] = sum(len(b) for b in self._blobs().values()) / n
        out["total"] = sum(out.values())
        return out


def _header(name: str, samples: int, buckets: Sequence[Hashable], bucket_by: Mapping[str, Any],
            exts: Sequence[str], digest: str) -> dict[str, Any]:
    return {"format": "wds_pad.index", "version": FORMAT_VERSION, "name": name, "samples": int(samples),
            "buckets": [_jsonable_key(b) for b in buckets], "bucket_by": dict(bucket_by),
            "exts": list(exts), "digest": digest}


def _digest(buckets: Sequence[Hashable], exts: Sequence[str], blobs: Mapping[str, bytes],
            arrays: Iterable[tuple[str, np.dtype, Iterable[np.ndarray]]]) -> str:
    """blake2b over everything but the name: the bucket and extension tables, then every
    section's dtype and bytes in file order (numeric ones streamed: chunks in order)."""
    h = hashlib.blake2b(digest_size=16)
    head = {"version": FORMAT_VERSION, "buckets": [_jsonable_key(b) for b in buckets], "exts": list(exts)}
    h.update(json.dumps(head, sort_keys=True).encode())
    for name, dtype, chunks in arrays:
        h.update(f"{name}:{np.dtype(dtype).str}".encode())
        for chunk in chunks:
            h.update(np.ascontiguousarray(chunk, dtype=dtype).data)
    for name in JSON_SECTIONS:
        h.update(f"{name}:|u1".encode())
        h.update(blobs[name])
    return h.hexdigest()


def _json_sections(index: Index) -> dict[str, bytes]:
    return {"shards": json.dumps([s.to_json() for s in index.shards], sort_keys=True).encode(),
            "excluded": json.dumps(dict(index.excluded), sort_keys=True).encode()}


def _pack_keys(keys: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """(offsets, UTF-8 bytes) of ``keys`` back to back: key i is ``bytes[offsets[i]:offsets[i + 1]]``."""
    offsets = np.zeros(len(keys) + 1, dtype=np.int64)
    if not keys:
        return offsets, np.zeros(0, np.uint8)
    joined = np.frombuffer("\0".join(keys).encode("utf-8"), np.uint8)
    ends = np.flatnonzero(joined == 0)
    if len(ends) != len(keys) - 1:  # a key holds a NUL (never one from a tar name): one by one
        encoded = [k.encode("utf-8") for k in keys]
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


def _grouped(shards: Sequence[ShardInfo], buckets: Sequence[Hashable], rows: Mapping[str, np.ndarray],
             key_offsets: np.ndarray, keys: np.ndarray, *, bucket_by: Mapping[str, Any], exts: Sequence[str],
             excluded: Mapping[str, Any] | None, name: str) -> Index:
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
    return Index(shards=tuple(shards), buckets=tuple(buckets), arrays=arrays, bucket_by=dict(bucket_by),
                 exts=tuple(exts), excluded=dict(excluded or {}), name=name)


def make_index(
    shards: Sequence[ShardInfo], rows: Mapping[str, np.ndarray], bucket_keys: Sequence[Hashable],
    keys: Sequence[str], *, bucket_by: Mapping[str, Any], exts: Sequence[str],
    excluded: Mapping[str, Any] | None = None, name: str = "index",
) -> Index:
    """Assemble an Index from per-sample rows in shard order (``rows["bucket"]`` indexes
    ``bucket_keys``): buckets re-numbered in canonical order, rows grouped by bucket."""
    ordered = sorted(set(bucket_keys), key=bucket_order)
    remap = np.asarray([ordered.index(k) for k in bucket_keys], dtype=np.int32)
    bucket = remap[np.asarray(rows["bucket"], np.int64)] if len(bucket_keys) else np.zeros(0, np.int32)
    key_offsets, key_bytes = _pack_keys(keys)
    return _grouped(shards, ordered, {**rows, "bucket": bucket}, key_offsets, key_bytes, bucket_by=bucket_by,
                    exts=exts, excluded=excluded, name=name)


# -- bytes -----------------------------------------------------------------------------
Section = tuple[str, np.dtype, int, Callable[[], Iterable[Any]]]  # name, dtype, count, chunks


def _file_parts(header: dict[str, Any], sections: Sequence[Section]) -> Iterator[bytes | memoryview]:
    """The bytes of one index file: prefix, header (with the section layout), sections."""
    layout: dict[str, dict[str, Any]] = {}
    pos = 0
    for name, dtype, count, _ in sections:
        layout[name] = {"dtype": np.dtype(dtype).str, "offset": pos, "count": int(count)}
        pos += -(-(int(count) * np.dtype(dtype).itemsize) // _ALIGN) * _ALIGN
    raw = json.dumps({**header, "sections": layout}, sort_keys=True).encode("utf-8")
    yield _PREFIX.pack(MAGIC, FORMAT_VERSION, zlib.crc32(raw), len(raw))
    yield raw
    yield b"\0" * (-(_PREFIX.size + len(raw)) % _ALIGN)
    for name, dtype, count, chunks in sections:
        written = 0
        for chunk in chunks():
            data = np.ascontiguousarray(chunk, dtype=dtype)
            written += data.size
            if data.size:
                yield memoryview(data).cast("B")
        if written != count:  # pragma: no cover - a bug in a section's producer
            raise IndexFormatError(f"index section {name!r}: wrote {written} values, its layout says {count}")
        yield b"\0" * (-(int(count) * np.dtype(dtype).itemsize) % _ALIGN)


def serialize(index: Index) -> list[bytes | memoryview]:
    """The bytes of ``index``'s file, in order."""
    blobs = index._blobs()
    sections: list[Section] = [(k, index.arrays[k].dtype, index.arrays[k].size, lambda a=index.arrays[k]: [a])
                               for k in index.numeric_sections()]
    sections += [(k, np.dtype(np.uint8), len(b), lambda b=b: [np.frombuffer(b, np.uint8)]) for k, b in blobs.items()]
    return list(_file_parts(index.header(), sections))


def columns_parts(name: str, shards: Sequence[ShardInfo], buckets: Sequence[Hashable], bucket_by: Mapping[str, Any],
                  exts: Sequence[str], excluded: Mapping[str, Any], columns: Mapping[str, Callable[[], Iterable[Any]]],
                  *, samples: int, key_bytes: int, max_offset: int, max_length: int,
                  members: int | None = None, max_member_size: int = 0,
                  max_member_offset: int = 0) -> Iterator[bytes | memoryview]:
    """The bytes of an index file whose numeric sections come from chunk producers.

    Nothing is held but one chunk at a time: each producer is called twice (once for the
    digest, once for the bytes) and must yield the same chunks both times.

    Args:
        name: the index's dataset name.
        shards: the shard table.
        buckets: the bucket table, in canonical order (``bucket_order``).
        bucket_by: how the buckets were computed (``BucketFn.describe()``).
        exts: the member-extension table (bit i of a mask is ``exts[i]``).
        excluded: the excluded-samples record.
        columns: per numeric section (``ARRAYS``: bucket_offsets, shard, offset, length,
            exts, key_offsets, keys) a zero-argument callable giving its values in row
            order as chunks (any integer dtype; each is cast to the section's dtype).
        samples: rows of the index.
        key_bytes: the total UTF-8 bytes of the keys (the ``keys`` section's size).
        max_offset: the largest ``offset`` value (chooses the column's width).
        max_length: the largest ``length`` value (chooses the column's width).
        members: with the member table (``columns`` then also has ``MEMBER_ARRAYS``), its
            total number of members; None: no member table.
        max_member_size: the largest ``member_size`` value.
        max_member_offset: the largest ``member_offset`` value.

    Raises:
        IndexFormatError: a section missing from ``columns``, or a producer that gives
            another number of values than its section holds.
    """
    names = ARRAYS + (MEMBER_ARRAYS if members is not None else ())
    missing = [k for k in names if k not in columns]
    if missing:
        raise IndexFormatError(f"index {name!r}: no producer for section(s) {missing}")
    dt = column_dtypes(len(shards), max_offset, max_length, key_bytes, len(exts))
    counts = {"bucket_offsets": len(buckets) + 1, "key_offsets": samples + 1, "keys": key_bytes,
              **{k: samples for k in ROW_ARRAYS}}
    if members is not None:
        dt.update(member_dtypes(members, max_member_size, max_member_offset))
        counts.update(member_start=samples + 1, member_ext=members, member_size=members, member_offset=members)
    blobs = {"shards": json.dumps([s.to_json() for s in shards], sort_keys=True).encode(),
             "excluded": json.dumps(dict(excluded), sort_keys=True).encode()}
    digest = _digest(buckets, exts, blobs, ((k, dt[k], columns[k]()) for k in names))
    sections: list[Section] = [(k, dt[k], counts[k], columns[k]) for k in names]
    sections += [(k, np.dtype(np.uint8), len(b), lambda b=b: [np.frombuffer(b, np.uint8)]) for k, b in blobs.items()]
    yield from _file_parts(_header(name, samples, buckets, bucket_by, exts, digest), sections)


def merged_parts(parts: Sequence[Index], *, name: str, excluded_limit: int = 10_000) -> Iterator[bytes | memoryview]:
    """The bytes of the index of ``parts``' shards, in part order, without holding it.

    Each part is an index of consecutive shards; the result is byte-identical to
    ``serialize`` of one build of all the shards (buckets and extensions re-numbered in
    the canonical tables, rows grouped by bucket, then part, then row). Memory: the
    tables and one slice of one part at a time.

    Raises:
        IndexFormatError: the parts were bucketed differently, or use more than 64
            distinct member extensions together.
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

    # (part number, lo, hi) of every non-empty slice, in merged row order: computed once
    # (bucket offsets only), walked once per section
    order: list[tuple[int, int, int]] = []
    offsets = [p.bucket_offsets.tolist() for p in parts]
    local_lists = [loc.tolist() for loc in local]
    for b in range(len(buckets)):
        for j in range(len(parts)):
            lb = local_lists[j][b]
            if lb >= 0 and offsets[j][lb + 1] > offsets[j][lb]:
                order.append((j, offsets[j][lb], offsets[j][lb + 1]))

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
    yield from columns_parts(name, shards, buckets, bucket_by, exts, excluded, producers, samples=n,
                             key_bytes=key_total, max_offset=max_offset, max_length=max_length, **members)


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


# -- reading ---------------------------------------------------------------------------
def _damaged(path: str, what: str) -> IndexFormatError:
    return IndexFormatError(
        f"index {path!r} is damaged ({what}); rebuild it with `wds-pad index ... -o {path}`"
    )


def load_index(path: str, *, verify: bool | None = None,
               storage_options: Mapping[str, Any] | None = None, convert: bool = False) -> Index:
    """Load an index written by :func:`write_index` (memory-mapped when local).

    Nothing per sample is parsed or read: the sections are views of the mapped file, and
    the shard table and excluded samples are parsed on first use.

    Args:
        path: local path or fsspec URL.
        verify: recompute the content digest (default: only for files up to 256 MiB).
        storage_options: fsspec options for remote paths.
        convert: also read a version-1 file, converted in memory to the current layout
            (what ``wds-pad index --update`` does before writing it back).

    Raises:
        IndexFormatError: missing file, not an index, another format version (a
            version-1 file: with the command that converts it), a damaged header or
            truncated sections, or (verify) a digest mismatch.
        ReadError: a remote index whose store cannot be reached, found no credentials
            or refused the read (the message says what to check).
    """
    buf: Any
    local = local_path(path)
    if local is not None:
        try:
            with open(local, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
        except FileNotFoundError:
            raise IndexFormatError(f"index {path!r} does not exist; build it with `wds-pad index`") from None
        except IsADirectoryError:
            raise IndexFormatError(f"index {path!r} is a directory, not an index file") from None
    else:
        from ..io.faults import call_store
        from ..io.fs import get_filesystem

        fs, fpath = get_filesystem(path, storage_options)
        buf = call_store(lambda: fs.cat_file(fpath), path, what="index", missing=IndexFormatError,
                         fix="build it with `wds-pad index`")
    if len(buf) < _PREFIX.size:
        raise IndexFormatError(f"{path!r} is not a wds_pad index (file of {len(buf)} bytes)")
    magic, version, crc, hlen = _PREFIX.unpack_from(buf, 0)
    if magic != MAGIC:
        raise IndexFormatError(f"{path!r} is not a wds_pad index (bad magic); build one with `wds-pad index`")
    if version == 1 and not convert:
        raise IndexFormatError(
            f"index {path!r} has format version 1, which this wds_pad no longer plans from (version "
            f"{FORMAT_VERSION} groups rows by bucket so a rank reads no per-sample column to plan); "
            + CONVERT_HINT.format(path=path)
        )
    if version not in (1, FORMAT_VERSION):
        raise IndexFormatError(
            f"index {path!r} has format version {version}, this wds_pad reads version "
            f"{FORMAT_VERSION}; rebuild it with `wds-pad index` (or use a matching wds_pad)"
        )
    if _PREFIX.size + hlen > len(buf):
        raise _damaged(path, "truncated header")
    raw = bytes(buf[_PREFIX.size : _PREFIX.size + hlen])
    if zlib.crc32(raw) != crc:
        raise _damaged(path, "header checksum mismatch")
    try:
        header = json.loads(raw)
    except ValueError:
        raise _damaged(path, "header is not JSON") from None
    base = _PREFIX.size + hlen
    base += -base % _ALIGN
    arrays: dict[str, np.ndarray] = {}
    try:
        for k, spec in header["sections" if version > 1 else "arrays"].items():
            dtype = np.dtype(spec["dtype"])
            start, count = base + int(spec["offset"]), int(spec["count"])
            if start + count * dtype.itemsize > len(buf):
                raise _damaged(path, f"section {k!r} is truncated: file has {len(buf)} bytes")
            arrays[k] = np.frombuffer(buf, dtype=dtype, count=count, offset=start)
        if version == 1:
            index = _from_v1(header, arrays, path)
        else:
            blobs = {k: arrays.pop(k) for k in JSON_SECTIONS}
            index = Index(
                shards=lambda: _shard_table(blobs["shards"], path),
                buckets=tuple(_key_from_json(b) for b in header["buckets"]), arrays=arrays,
                bucket_by=header["bucket_by"], exts=tuple(header["exts"]),
                excluded=lambda: _json_blob(blobs["excluded"], path, "excluded"),
                name=header["name"], path=path, digest=header["digest"],
            )
            index.__dict__["_raw_sections"] = {k: memoryview(v) for k, v in blobs.items()}
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, IndexFormatError):
            raise
        raise _damaged(path, f"unexpected header layout: {exc}") from exc
    if verify is None:
        verify = len(buf) <= VERIFY_LIMIT
    if verify and version > 1 and index._compute_digest() != index.digest:
        raise _damaged(path, "content digest mismatch")
    return index


def _json_blob(blob: np.ndarray, path: str, what: str) -> Any:
    try:
        return json.loads(bytes(blob))
    except ValueError:
        raise _damaged(path, f"section {what!r} is not JSON") from None


def _shard_table(blob: np.ndarray, path: str) -> tuple[ShardInfo, ...]:
    try:
        return tuple(ShardInfo(**s) for s in _json_blob(blob, path, "shards"))
    except TypeError as exc:
        raise _damaged(path, f"unexpected shard table: {exc}") from exc


def _from_v1(header: Mapping[str, Any], arrays: Mapping[str, np.ndarray], path: str) -> Index:
    """A version-1 file's index in the current layout (rows grouped by bucket, in memory)."""
    old = {k: arrays[k] for k in _V1_DTYPES}
    h = hashlib.blake2b(digest_size=16)
    head = {"shards": [[s["url"], s["size"], s["stamp"], s["samples"]] for s in header["shards"]],
            "buckets": header["buckets"], "exts": list(header["exts"])}
    h.update(json.dumps(head, sort_keys=True).encode())
    for k in _V1_DTYPES:
        h.update(np.ascontiguousarray(old[k]).data)
    if h.hexdigest() != header["digest"]:
        raise _damaged(path, "content digest mismatch (a version-1 file)")
    return _grouped(tuple(ShardInfo(**s) for s in header["shards"]),
                    tuple(_key_from_json(b) for b in header["buckets"]), old, old["key_offsets"], old["keys"],
                    bucket_by=header["bucket_by"], exts=header["exts"], excluded=header["excluded"],
                    name=header["name"])
