"""The index file's bytes: an Index to bytes (``serialize``, ``columns_parts``) and back
(``load_index``), in the layout of :mod:`.layout`.

Invariants:
- ``serialize`` gives the bytes of one file, ``columns_parts`` the same bytes from chunk
  producers without holding the sections (what :func:`.merge.merged_parts` writes
  through); ``index.output`` checks where they go and writes them atomically;
- ``load_index`` refuses a wrong magic, a damaged header (crc32), a truncated file, and
  (``verify=True``, the default for files up to 256 MiB) a wrong digest; a file of
  another format version is refused in one line naming the version and the command that
  rebuilds it;
- local files are memory-mapped: ranks and DataLoader workers share the pages, loading
  parses nothing per sample, and planning touches no per-sample section;
- shard URLs stored relative to the file resolve against where it is loaded from (or
  ``location``), then ``relocate`` moves them (:mod:`.location`); the digest is of the
  bytes as stored, so neither changes it.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import zlib
from typing import Any, Callable, Hashable, Iterable, Iterator, Mapping, Sequence

import numpy as np

from ..errors import IndexFormatError, ReadError
from ..io.descriptors import out_of_descriptors, runs_out
from ..io.urls import local_path
from .layout import (
    ARRAYS,
    COST_ARRAYS,
    FORMAT_VERSION,
    JSON_SECTIONS,
    MAGIC,
    MEMBER_ARRAYS,
    ROW_ARRAYS,
    column_dtypes,
    content_digest,
    file_header,
    json_sections,
    key_from_json,
    member_dtypes,
    stored_urls,
)
from .location import RELATIVE_KEY, Relocation, check_relocation, excluded_urls, index_folder, resolve_url, unmatched
from .record import Index, ShardInfo

__all__ = ["VERIFY_LIMIT", "columns_parts", "load_index", "serialize"]

_PREFIX = struct.Struct("<8sIIQ")
_ALIGN = 64
VERIFY_LIMIT = 256 * 2**20


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
    blobs = index.json_blobs()
    sections: list[Section] = [(k, index.arrays[k].dtype, index.arrays[k].size, lambda a=index.arrays[k]: [a])
                               for k in index.numeric_sections()]
    sections += [(k, np.dtype(np.uint8), len(b), lambda b=b: [np.frombuffer(b, np.uint8)]) for k, b in blobs.items()]
    return list(_file_parts(index.header(), sections))


def columns_parts(name: str, shards: Sequence[ShardInfo], buckets: Sequence[Hashable], bucket_by: Mapping[str, Any],
                  exts: Sequence[str], excluded: Mapping[str, Any], columns: Mapping[str, Callable[[], Iterable[Any]]],
                  *, samples: int, key_bytes: int, max_offset: int, max_length: int,
                  members: int | None = None, max_member_size: int = 0,
                  max_member_offset: int = 0, cost: tuple[str, np.dtype, np.dtype] | None = None,
                  path: str | None = None) -> Iterator[bytes | memoryview]:
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
        cost: with costs (``columns`` then also has ``COST_ARRAYS``): their kind
            (``"json:tokens"``), the ``cost`` and the ``cost_order`` dtypes; None: none.
        path: where the file goes: shard URLs beside or below it are stored relative
            to its folder (None: as given).

    Raises:
        IndexFormatError: a section missing from ``columns``, or a producer that gives
            another number of values than its section holds.
    """
    names = ARRAYS + (MEMBER_ARRAYS if members is not None else ()) + (COST_ARRAYS if cost is not None else ())
    missing = [k for k in names if k not in columns]
    if missing:
        raise IndexFormatError(f"index {name!r}: no producer for section(s) {missing}")
    dt = column_dtypes(len(shards), max_offset, max_length, key_bytes, len(exts))
    counts = {"bucket_offsets": len(buckets) + 1, "key_offsets": samples + 1, "keys": key_bytes,
              **{k: samples for k in ROW_ARRAYS}}
    if members is not None:
        dt.update(member_dtypes(members, max_member_size, max_member_offset))
        counts.update(member_start=samples + 1, member_ext=members, member_size=members, member_offset=members)
    kind = None
    if cost is not None:
        kind = cost[0]
        dt.update(cost=np.dtype(cost[1]), cost_order=np.dtype(cost[2]))
        counts.update(cost=samples, cost_order=samples)
    folder = index_folder(path)
    relative = stored_urls([s.url for s in shards], folder)[1]
    blobs = json_sections(shards, excluded, folder)
    digest = content_digest(buckets, exts, blobs, ((k, dt[k], columns[k]()) for k in names), cost=kind,
                            relative=relative)
    sections: list[Section] = [(k, dt[k], counts[k], columns[k]) for k in names]
    sections += [(k, np.dtype(np.uint8), len(b), lambda b=b: [np.frombuffer(b, np.uint8)]) for k, b in blobs.items()]
    yield from _file_parts(file_header(name, samples, buckets, bucket_by, exts, digest, cost=kind,
                                       relative=relative), sections)


def _damaged(path: str, what: str) -> IndexFormatError:
    return IndexFormatError(
        f"index {path!r} is damaged ({what}); rebuild it with `wds-pad index ... -o {path}`"
    )


def load_index(path: str, *, verify: bool | None = None,
               storage_options: Mapping[str, Any] | None = None,
               relocate: Mapping[str, str] | None = None, location: str | None = None) -> Index:
    """Load an index written by :func:`write_index` (memory-mapped when local).

    Nothing per sample is parsed or read: the sections are views of the mapped file, and
    the shard table and excluded samples are parsed on first use (at once with
    ``relocate``, to check it). Shard URLs stored relative to the file (shards beside or
    below it) resolve against where it is now: a dataset folder moved whole loads as is.

    Args:
        path: local path or fsspec URL.
        verify: recompute the content digest (default: only for files up to 256 MiB).
        storage_options: fsspec options for remote paths.
        relocate: ``{old prefix: new prefix}`` applied to every shard URL (after a
            relative one is resolved): the shards moved elsewhere. Sizes and change
            stamps are still checked against the values indexed when shards are read.
        location: where the file belongs if ``path`` is a copy of it (relative shard
            URLs resolve against ``location``; the index's ``path`` is ``location``).

    Raises:
        ConfigError: a ``relocate`` that is not a mapping of URL prefixes, or whose old
            prefix matches no shard URL of the index.
        IndexFormatError: missing file, not an index, another format version (in
            one line naming it and the command that rebuilds the file), a damaged header or
            truncated sections, or (verify) a digest mismatch.
        ReadError: a remote index whose store cannot be reached, found no credentials
            or refused the read; a local one this account may not read, or opened when
            the process has no file descriptor left (the message says what to check).
    """
    buf: Any
    relocation = check_relocation(relocate)
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
        except OSError as exc:
            raise _unreadable(path, exc) from None
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
        made = ("an earlier wds_pad 0.1 (before rows were grouped by bucket)" if version < FORMAT_VERSION
                else "a newer wds_pad")
        raise IndexFormatError(
            f"index {path!r} has format version {version}, written by {made}; this wds_pad reads version "
            f"{FORMAT_VERSION}: rebuild it with `wds-pad index SHARDS... -o {path}`")
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
        for k, spec in header["sections"].items():
            dtype = np.dtype(spec["dtype"])
            start, count = base + int(spec["offset"]), int(spec["count"])
            if start + count * dtype.itemsize > len(buf):
                raise _damaged(path, f"section {k!r} is truncated: file has {len(buf)} bytes")
            arrays[k] = np.frombuffer(buf, dtype=dtype, count=count, offset=start)
        where = location or path
        folder = index_folder(where) if header.get(RELATIVE_KEY) else None
        blobs = {k: arrays.pop(k) for k in JSON_SECTIONS}
        index = Index(
            shards=lambda: _shard_table(blobs["shards"], path, folder, relocation),
            buckets=tuple(key_from_json(b) for b in header["buckets"]), arrays=arrays,
            bucket_by=header["bucket_by"], exts=tuple(header["exts"]),
            excluded=lambda: excluded_urls(_json_blob(blobs["excluded"], path, "excluded"),
                                           lambda u: resolve_url(u, folder, relocation)),
            name=header["name"], path=where, digest=header["digest"],
            json_bytes={k: memoryview(v) for k, v in blobs.items()},
            cost_kind=header.get("cost"), relocate=relocation, relative=bool(header.get(RELATIVE_KEY)),
        )
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, IndexFormatError):
            raise
        raise _damaged(path, f"unexpected header layout: {exc}") from exc
    if relocation:  # an old prefix that moves nothing is a typo: refused, not ignored
        recorded = [resolve_url(u, folder) for u in index.stored_urls]
        unmatched(relocation, recorded, index.path or path)
    if verify is None:
        verify = len(buf) <= VERIFY_LIMIT
    if verify and index.compute_digest() != index.digest:
        raise _damaged(path, "content digest mismatch")
    return index


def _unreadable(path: str, exc: OSError) -> ReadError:
    """The error for a local index file that exists but cannot be opened or mapped."""
    if runs_out(exc):
        return out_of_descriptors(f"cannot open index {path!r}", exc, fewer="DataLoader workers or open files")
    if isinstance(exc, PermissionError):
        return ReadError(f"cannot read index {path!r}: permission denied for this account; ask the account "
                         f"that built it to make it readable (chmod a+r {path}), or build one you can read")
    return ReadError(f"cannot read index {path!r}: {exc.strerror or exc}; check the file and its filesystem")


def _json_blob(blob: np.ndarray, path: str, what: str) -> Any:
    try:
        return json.loads(bytes(blob))
    except ValueError:
        raise _damaged(path, f"section {what!r} is not JSON") from None


def _shard_table(blob: np.ndarray, path: str, folder: str | None = None,
                 relocation: Relocation = ()) -> tuple[ShardInfo, ...]:
    """The shard table, its URLs resolved against ``folder`` and relocated."""
    try:
        table = [ShardInfo(**s) for s in _json_blob(blob, path, "shards")]
    except TypeError as exc:
        raise _damaged(path, f"unexpected shard table: {exc}") from exc
    if folder is None and not relocation:
        return tuple(table)
    return tuple(ShardInfo(**{**s.to_json(), "url": resolve_url(s.url, folder, relocation)}) for s in table)
