"""The index: per sample its shard, byte range, key and bucket, saved once, memory-mapped.

On-disk format (one file, version ``FORMAT_VERSION``)::

    b"WDSPADIX" | u32 version | u32 header crc32 | u64 header length | header JSON
    | zero padding to 64 bytes | arrays, each 64-byte aligned

The JSON header holds the shard table, the bucket table, how buckets were computed,
the excluded samples, the member-extension table, each array's dtype/offset/length and
a content digest (blake2b over the arrays and the planning-relevant header fields).

Invariants:
- ``serialize`` gives the bytes of one file; ``index.output`` checks where they go and
  writes them atomically (temp file + rename locally; a single PUT elsewhere);
- ``load_index`` refuses a wrong magic/version, a damaged header (crc32), a truncated
  file, and (``verify=True``, the default for files up to 256 MiB) a wrong digest;
- local files are memory-mapped: ranks and DataLoader workers share the pages, and
  10^8 samples load without any per-sample parsing.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import struct
import zlib
from dataclasses import dataclass, field
from typing import Any, Hashable, Mapping, Sequence

import numpy as np

from ..core.dataset import Dataset, bucket_order
from ..errors import IndexFormatError

__all__ = ["FORMAT_VERSION", "MAGIC", "Index", "ShardInfo", "load_index", "make_index", "serialize"]

FORMAT_VERSION = 1
MAGIC = b"WDSPADIX"
_PREFIX = struct.Struct("<8sIIQ")
_ALIGN = 64
VERIFY_LIMIT = 256 * 2**20
ARRAY_DTYPES = {
    "shard": np.int32,
    "offset": np.int64,
    "length": np.int64,
    "bucket": np.int32,
    "exts": np.uint64,
    "key_offsets": np.int64,
    "keys": np.uint8,
}


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


@dataclass(frozen=True, eq=False)
class Index:
    """A loaded (or freshly built) index. Sample ids are row numbers ``0..len-1``."""

    shards: tuple[ShardInfo, ...]
    buckets: tuple[Hashable, ...]          # bucket table (canonical order)
    arrays: Mapping[str, np.ndarray]
    bucket_by: Mapping[str, Any]
    exts: tuple[str, ...] = ()
    excluded: Mapping[str, Any] = field(default_factory=dict)
    name: str = "index"
    path: str | None = None
    digest: str = ""

    def __post_init__(self) -> None:
        missing = [k for k in ARRAY_DTYPES if k not in self.arrays]
        if missing:
            raise IndexFormatError(f"index {self.path or self.name!r} lacks array(s) {missing}")
        n = self.arrays["shard"].size
        for k in ("offset", "length", "bucket", "exts"):
            if self.arrays[k].size != n:
                raise IndexFormatError(
                    f"index {self.path or self.name!r} is damaged: array {k!r} has "
                    f"{self.arrays[k].size} rows, expected {n}; rebuild it with `wds-pad index`"
                )
        if self.arrays["key_offsets"].size != n + 1:
            raise IndexFormatError(f"index {self.path or self.name!r} is damaged: key table size")
        if not self.digest:
            object.__setattr__(self, "digest", self._compute_digest())

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
    def bucket(self) -> np.ndarray:
        return self.arrays["bucket"]

    @property
    def urls(self) -> tuple[str, ...]:
        return tuple(s.url for s in self.shards)

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
        counts = np.bincount(self.bucket, minlength=len(self.buckets))
        return {k: int(c) for k, c in zip(self.buckets, counts)}

    def bucket_bytes(self) -> dict[Hashable, int]:
        sums = np.bincount(self.bucket, weights=self.length, minlength=len(self.buckets))
        return {k: int(c) for k, c in zip(self.buckets, sums)}

    def bucket_samples(self) -> dict[Hashable, np.ndarray]:
        """Bucket key -> sorted sample ids (one stable argsort, no per-sample Python)."""
        order = np.argsort(self.bucket, kind="stable").astype(np.int64)
        bounds = np.searchsorted(self.bucket[order], np.arange(len(self.buckets) + 1))
        return {k: order[bounds[i] : bounds[i + 1]] for i, k in enumerate(self.buckets)}

    def to_dataset(self, name: str | None = None, repeats: int = 0, weight: float = 1.0) -> Dataset:
        """This index as one planner Dataset (its buckets, these repeats and weight)."""
        return Dataset(name=name or self.name, buckets=self.bucket_samples(), repeats=repeats, weight=weight)

    # -- digest --------------------------------------------------------------------------
    def _compute_digest(self) -> str:
        h = hashlib.blake2b(digest_size=16)
        head = {"shards": [[s.url, s.size, s.stamp, s.samples] for s in self.shards],
                "buckets": [_jsonable_key(b) for b in self.buckets], "exts": list(self.exts)}
        h.update(json.dumps(head, sort_keys=True).encode())
        for k in ARRAY_DTYPES:
            h.update(np.ascontiguousarray(self.arrays[k]).data)
        return h.hexdigest()

    def header(self) -> dict[str, Any]:
        return {
            "format": "wds_pad.index",
            "version": FORMAT_VERSION,
            "name": self.name,
            "samples": len(self),
            "shards": [s.to_json() for s in self.shards],
            "buckets": [_jsonable_key(b) for b in self.buckets],
            "bucket_by": dict(self.bucket_by),
            "exts": list(self.exts),
            "excluded": dict(self.excluded),
            "digest": self.digest,
        }


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


def make_index(
    shards: Sequence[ShardInfo], rows: Mapping[str, np.ndarray], bucket_keys: Sequence[Hashable],
    keys: Sequence[str], *, bucket_by: Mapping[str, Any], exts: Sequence[str],
    excluded: Mapping[str, Any] | None = None, name: str = "index",
) -> Index:
    """Assemble an Index from per-sample rows; re-numbers buckets in canonical order."""
    ordered = sorted(set(bucket_keys), key=bucket_order)
    remap = np.asarray([ordered.index(k) for k in bucket_keys], dtype=np.int32)
    bucket = remap[rows["bucket"]] if len(bucket_keys) else np.zeros(0, np.int32)
    key_offsets, key_bytes = _pack_keys(keys)
    arrays = {
        "shard": np.asarray(rows["shard"], dtype=np.int32),
        "offset": np.asarray(rows["offset"], dtype=np.int64),
        "length": np.asarray(rows["length"], dtype=np.int64),
        "bucket": np.asarray(bucket, dtype=np.int32),
        "exts": np.asarray(rows["exts"], dtype=np.uint64),
        "key_offsets": key_offsets,
        "keys": key_bytes,
    }
    return Index(shards=tuple(shards), buckets=tuple(ordered), arrays=arrays, bucket_by=dict(bucket_by),
                 exts=tuple(exts), excluded=dict(excluded or {}), name=name)


# -- bytes -----------------------------------------------------------------------------
def serialize(index: Index) -> list[bytes | memoryview]:
    layout: dict[str, dict[str, Any]] = {}
    pos = 0
    for k, dtype in ARRAY_DTYPES.items():
        nbytes = int(index.arrays[k].size) * np.dtype(dtype).itemsize
        layout[k] = {"dtype": np.dtype(dtype).str, "offset": pos, "count": int(index.arrays[k].size)}
        pos += -(-nbytes // _ALIGN) * _ALIGN
    header = index.header()
    header["arrays"] = layout
    raw = json.dumps(header, sort_keys=True).encode("utf-8")
    start = _PREFIX.size + len(raw)
    pad = -start % _ALIGN
    parts: list[bytes | memoryview] = [_PREFIX.pack(MAGIC, FORMAT_VERSION, zlib.crc32(raw), len(raw)), raw, b"\0" * pad]
    for k, dtype in ARRAY_DTYPES.items():
        data = np.ascontiguousarray(index.arrays[k], dtype=dtype)
        parts.append(memoryview(data).cast("B"))
        parts.append(b"\0" * (-data.nbytes % _ALIGN))
    return parts


# -- reading ---------------------------------------------------------------------------
def _damaged(path: str, what: str) -> IndexFormatError:
    return IndexFormatError(
        f"index {path!r} is damaged ({what}); rebuild it with `wds-pad index ... -o {path}`"
    )


def load_index(path: str, *, verify: bool | None = None,
               storage_options: Mapping[str, Any] | None = None) -> Index:
    """Load an index written by :func:`write_index` (memory-mapped when local).

    Args:
        path: local path or fsspec URL.
        verify: recompute the content digest (default: only for files up to 256 MiB).
        storage_options: fsspec options for remote paths.

    Raises:
        IndexFormatError: missing file, not an index, another format version, a
            damaged header or truncated arrays, or (verify) a digest mismatch.
        ReadError: a remote index whose store cannot be reached, found no credentials
            or refused the read (the message says what to check).
    """
    buf: Any
    if "://" not in path or path.startswith("file://"):
        local = path[len("file://"):] if path.startswith("file://") else path
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
    if version != FORMAT_VERSION:
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
        for k, spec in header["arrays"].items():
            dtype = np.dtype(spec["dtype"])
            start, count = base + int(spec["offset"]), int(spec["count"])
            if start + count * dtype.itemsize > len(buf):
                raise _damaged(path, f"array {k!r} is truncated: file has {len(buf)} bytes")
            arrays[k] = np.frombuffer(buf, dtype=dtype, count=count, offset=start)
        shards = tuple(ShardInfo(**s) for s in header["shards"])
        index = Index(
            shards=shards, buckets=tuple(_key_from_json(b) for b in header["buckets"]), arrays=arrays,
            bucket_by=header["bucket_by"], exts=tuple(header["exts"]), excluded=header["excluded"],
            name=header["name"], path=path, digest=header["digest"],
        )
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, IndexFormatError):
            raise
        raise _damaged(path, f"unexpected header layout: {exc}") from exc
    if verify is None:
        verify = len(buf) <= VERIFY_LIMIT
    if verify and index._compute_digest() != index.digest:
        raise _damaged(path, "content digest mismatch")
    return index
