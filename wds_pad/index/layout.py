"""What an index file is: its magic and version, its sections in file order and their
dtypes, its header, and its content digest.

The vocabulary shared by the record (:mod:`.record`, which checks its sections and
computes its digest) and the codec (:mod:`.codec`, which writes and reads the bytes).

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
- optional, the costs (``wds-pad index --cost``): ``cost`` [samples] each sample's cost,
  a non-negative number (the narrowest signed integer type holding every value when all
  are whole numbers, else float64), and ``cost_order`` [samples], each bucket's rows in
  cost order (ties by row id) as offsets from the bucket's first row (the narrowest
  signed type holding the largest bucket); the header's ``cost`` says what the number
  is (``"json:tokens"``, ``"image:pixels"``, ``"bytes"``);
- ``shards``, ``excluded``: JSON, for inspect, verify, update and the stale-shard check.
  A shard URL beside or below the index file is stored relative to its folder (the
  header's ``relative_urls`` is then true; :mod:`.location`).

Invariants:
- the digest covers everything but the name: the bucket and extension tables (and, when
  present, the cost kind and the relative-URL flag), then every section's dtype and bytes
  in file order, the shard table as stored (so moving a folder whole keeps the digest);
  the same index gives the same digest however it was made (a build, a merge, a load),
  and a changed byte changes it;
- a section's dtype is chosen from the largest values only (``column_dtypes``,
  ``member_dtypes``, ``cost_dtype``), so a build and a merge of the same shards choose
  alike;
- an index without costs, or without a URL stored relative, is byte for byte what it was
  before either existed: the optional sections and header fields are simply absent.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Hashable, Iterable, Mapping, Sequence

import numpy as np

from ..errors import IndexFormatError
from .location import RELATIVE_KEY, excluded_urls, is_relative, store_url

__all__ = ["ARRAYS", "COST_ARRAYS", "FORMAT_VERSION", "JSON_SECTIONS", "LEGACY_MEMBER_ARRAYS", "MAGIC",
           "MEMBER_ARRAYS", "ROW_ARRAYS", "column_dtypes", "content_digest", "cost_dtype", "cost_values",
           "file_header", "json_sections", "key_from_json", "member_dtypes", "narrowest_int", "plain_offsets",
           "stored_urls"]

FORMAT_VERSION = 2
MAGIC = b"WDSPADIX"
ROW_ARRAYS = ("shard", "offset", "length", "exts")           # one value per sample
ARRAYS = ("bucket_offsets", *ROW_ARRAYS, "key_offsets", "keys")  # the numeric sections, in file order
JSON_SECTIONS = ("shards", "excluded")
MEMBER_ARRAYS = ("member_start", "member_ext", "member_size", "member_offset")  # optional: the member table
LEGACY_MEMBER_ARRAYS = MEMBER_ARRAYS[:3]  # files written before member_offset: plain samples only
COST_ARRAYS = ("cost", "cost_order")  # optional: each sample's cost, each bucket's rows in cost order


def _jsonable_key(key: Hashable) -> Any:
    return list(key) if isinstance(key, tuple) else key


def key_from_json(value: Any) -> Hashable:
    return tuple(key_from_json(v) for v in value) if isinstance(value, list) else value


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


def narrowest_int(max_value: int) -> np.dtype:
    """The narrowest of int8, int16, int32, int64 holding values in [0, max_value]."""
    for dt in (np.int8, np.int16, np.int32, np.int64):
        if max_value <= np.iinfo(dt).max:
            return np.dtype(dt)
    raise IndexFormatError(f"value {max_value} does not fit an int64 index column")


def cost_dtype(integral: bool, max_value: float) -> np.dtype:
    """The ``cost`` section's dtype: the narrowest signed integer type holding
    ``max_value`` when every cost is a whole number, else float64."""
    return narrowest_int(int(max_value)) if integral else np.dtype(np.float64)


def cost_values(values: np.ndarray | Sequence[float]) -> np.ndarray:
    """Costs as one exact column: int64 when every value is a whole number that int64
    holds (``3.0`` is 3), else float64. The same values give the same column however
    they are cut into shards or parts."""
    if isinstance(values, np.ndarray):
        if values.dtype.kind in "iu":
            return values.astype(np.int64)
        f = values.astype(np.float64)
    else:
        vals = list(values)
        if all(type(v) is int for v in vals):
            try:
                return np.array(vals, dtype=np.int64)
            except OverflowError:  # past int64: kept as the nearest float64
                return np.array(vals, dtype=np.float64)
        f = np.array(vals, dtype=np.float64)
    if not f.size or (bool(np.all(np.floor(f) == f)) and float(np.abs(f).max()) < 2.0**63):
        return f.astype(np.int64)
    return f


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


def _optional(cost: str | None, relative: bool) -> dict[str, Any]:
    """The header fields an index has only with costs or a relative shard URL."""
    return {**({"cost": cost} if cost is not None else {}), **({RELATIVE_KEY: True} if relative else {})}


def file_header(name: str, samples: int, buckets: Sequence[Hashable], bucket_by: Mapping[str, Any],
            exts: Sequence[str], digest: str, *, cost: str | None = None, relative: bool = False) -> dict[str, Any]:
    return {"format": "wds_pad.index", "version": FORMAT_VERSION, "name": name, "samples": int(samples),
            "buckets": [_jsonable_key(b) for b in buckets], "bucket_by": dict(bucket_by),
            "exts": list(exts), "digest": digest, **_optional(cost, relative)}


def content_digest(buckets: Sequence[Hashable], exts: Sequence[str], blobs: Mapping[str, bytes],
            arrays: Iterable[tuple[str, np.dtype, Iterable[np.ndarray]]], *, cost: str | None = None,
            relative: bool = False) -> str:
    """blake2b over everything but the name: the bucket and extension tables (the cost
    kind and the relative-URL flag when present), then every section's dtype and bytes
    in file order (numeric ones streamed: chunks in order)."""
    h = hashlib.blake2b(digest_size=16)
    head = {"version": FORMAT_VERSION, "buckets": [_jsonable_key(b) for b in buckets], "exts": list(exts),
            **_optional(cost, relative)}
    h.update(json.dumps(head, sort_keys=True).encode())
    for name, dtype, chunks in arrays:
        h.update(f"{name}:{np.dtype(dtype).str}".encode())
        for chunk in chunks:
            h.update(np.ascontiguousarray(chunk, dtype=dtype).data)
    for name in JSON_SECTIONS:
        h.update(f"{name}:|u1".encode())
        h.update(blobs[name])
    return h.hexdigest()


def stored_urls(urls: Sequence[str], folder: str | None) -> tuple[list[str], bool]:
    """The shard URLs as an index in ``folder`` stores them, and whether any is relative.

    A URL beside or below the folder is stored relative to it; when one is, a local
    path relative to the working directory (``make_index`` takes any URL) is stored
    absolute, so that no stored URL is read as relative to the index by mistake."""
    stored = [store_url(u, folder) for u in urls]
    relative = any(s != u for s, u in zip(stored, urls))
    if relative:
        stored = [os.path.abspath(u) if s == u and is_relative(u) else s for s, u in zip(stored, urls)]
    return stored, relative


def json_sections(shards: Sequence[Any], excluded: Mapping[str, Any], folder: str | None = None) -> dict[str, bytes]:
    """The bytes of the JSON sections (the shard table, the excluded samples), as written
    by an index in ``folder`` (its shard URLs stored as :func:`stored_urls` says)."""
    urls, relative = stored_urls([s.url for s in shards], folder)
    if relative:
        as_stored = dict(zip((s.url for s in shards), urls))
        excluded = excluded_urls(excluded, lambda u: as_stored.get(u, u))
    return {"shards": json.dumps([{**s.to_json(), "url": u} for s, u in zip(shards, urls)], sort_keys=True).encode(),
            "excluded": json.dumps(dict(excluded), sort_keys=True).encode()}
