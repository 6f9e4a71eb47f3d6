"""One shard on its filesystem: its size and change stamp, and opening it for a scan.

Invariants:
- ``shard_info`` is the one definition of a shard's (size, change stamp) that build,
  update, verify and the shard-level stream compare; the stamp comes from
  ``wds_pad.io.stale.change_stamp``, the same function the range reader checks against;
- a plain absolute local path is stat-ed and opened with ``os`` calls only (no fsspec
  filesystem is built); any other URL goes through fsspec;
- a missing or unreadable shard is a ``ShardError`` naming the (redacted) URL; a store
  that cannot be reached is a ``ReadError`` (nothing is known about the shard);
- ``stat_shards`` stats many shards concurrently and answers in URL order, a failed
  shard's ``ShardError`` in its place, so what is missing is known, and said, the same
  way on every run;
- a local shard opens unbuffered and seekable (the scan seeks past payloads); a remote
  one opens as one read-ahead stream (the scan reads it through once); a process out of
  descriptors is a ``ReadError`` about the limit (``wds_pad.io.descriptors``), not the shard's;
- a shard costs at most one request beyond its reads: ``stat_shard`` is one ``info``
  (a HEAD over HTTP and S3) that also says whether the URL is a prefix, and
  ``open_for_scan(..., size=...)`` hands that size to the filesystem, which then opens
  without a HEAD of its own;
- a remote shard's stream is hashed as the scan reads it (:class:`Hashed`): read through to
  its end once the scan is done, it gives the identity of the object's bytes
  (``ShardInfo.content``), at no extra request; a stream the scan moved about in gives none.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import io
import os
import stat
from typing import Any, Mapping, Sequence

from ..errors import ShardError
from ..io.descriptors import out_of_descriptors, runs_out
from ..io.faults import call_store
from ..io.fs import get_filesystem
from ..io.redact import redact
from ..io.stale import change_stamp as _stamp  # one definition: the reader checks against it
from ..io.urls import is_local

__all__ = ["Hashed", "Stat", "content_of", "directory_error", "is_missing", "missing_shards", "not_a_prefix", "open_for_scan",
           "plain_local", "shard_info", "stat_first", "stat_shard", "stat_shards"]

Stat = tuple[int, str, bool]  # (size, change stamp, is a directory): what stat_shard gives

# filesystems whose ``open`` takes the size it would otherwise ask the store for (a HEAD)
_SIZED_OPEN = frozenset({"http", "https", "s3", "s3a", "gs", "gcs", "az", "abfs", "abfss"})


def plain_local(url: str) -> bool:
    """An absolute local path without a protocol or chain: os calls need no fsspec."""
    return url.startswith("/") and is_local(url)


def shard_info(url: str, storage_options: Mapping[str, Any] | None = None) -> tuple[int, str]:
    """(size, change stamp) of one shard.

    Raises:
        ShardError: It does not exist or is not readable.
        ReadError: Its store cannot be reached or found no credentials (not the shard's
            fault: nothing is known about it).
    """
    size, stamp, _ = stat_shard(url, storage_options)
    return size, stamp


def stat_shard(url: str, storage_options: Mapping[str, Any] | None = None) -> Stat:
    """(size, change stamp, is a directory) of one shard, from one ``info`` call.

    The third value is True for a local directory or an object-store prefix (which
    lists as a directory of size 0), so nobody needs to ask the store again.

    Raises:
        ShardError: It does not exist or is not readable.
        ReadError: Its store cannot be reached or found no credentials (not the shard's
            fault: nothing is known about it).
    """
    if plain_local(url):
        try:  # what fsspec's LocalFileSystem.info gives, without building its dict
            st = os.stat(url)
        except FileNotFoundError:
            raise ShardError(f"shard {redact(url)!r} does not exist; check the URL or pattern") from None
        except PermissionError as exc:
            raise ShardError(f"shard {redact(url)!r} is not readable: permission denied") from exc
        return st.st_size, _stamp({"mtime": st.st_mtime}), stat.S_ISDIR(st.st_mode)
    fs, path = get_filesystem(url, storage_options)
    info = call_store(lambda: fs.info(path), url)
    size = info.get("size")
    is_dir = info.get("type") == "directory"
    if size is None:
        if is_dir:
            return 0, "", True
        raise ShardError(f"shard {redact(url)!r}: the filesystem reports no size")
    return int(size), _stamp(info), is_dir


def stat_shards(urls: Sequence[str], workers: int,
                storage_options: Mapping[str, Any] | None = None) -> list[Stat | ShardError]:
    """:func:`stat_shard` of each of ``urls``, ``workers`` at a time, in URL order.

    A shard that is missing or unreadable gives its ``ShardError`` in its place, so the
    caller can say how many there are and name the first, the same one on every run.

    Raises:
        ReadError: A store cannot be reached or found no credentials (the first such
            shard in URL order).
    """
    def one(url: str) -> Stat | ShardError:
        try:
            return stat_shard(url, storage_options)
        except ShardError as exc:
            return exc

    if workers <= 1 or len(urls) <= 1:
        return [one(u) for u in urls]
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(workers, len(urls))) as pool:
        return list(pool.map(one, urls))


def is_missing(error: ShardError) -> bool:
    """Whether a ``ShardError`` of :func:`stat_shard` says the shard does not exist (rather
    than that it cannot be read)."""
    cause = error.__cause__ if error.__cause__ is not None else error.__context__
    return isinstance(cause, FileNotFoundError)


def directory_error(url: str) -> ShardError:
    """The error for a shard URL that names a directory, with the pattern to use instead."""
    return ShardError(f"shard {redact(url)!r} is a directory, not a tar file; list the shards in it "
                      f"instead, e.g. {redact(url.rstrip('/')) + '/*.tar'!r}")


def not_a_prefix(url: str, storage_options: Mapping[str, Any] | None) -> None:
    """Raise IsADirectoryError if ``url`` (listed with size 0) is a prefix with objects under it."""
    fs, path = get_filesystem(url, storage_options)
    try:
        is_dir = fs.isdir(path)
    except OSError:
        return  # the scan reports it
    if is_dir:
        raise IsADirectoryError(path)


def open_for_scan(url: str, storage_options: Mapping[str, Any] | None,
                  size: int | None = None, stamp: str | None = None) -> tuple[Any, bool]:
    """(binary file, seekable): unbuffered local files, read-ahead streams elsewhere.

    Args:
        url: the shard.
        storage_options: fsspec options for a remote shard.
        size: the shard's size, if known (``stat_shard``): a remote file then opens
            without asking the store for it again (no HEAD), and an empty one is not
            opened at all.
    """
    if plain_local(url):
        return _open_local(url, url), True
    fs, path = get_filesystem(url, storage_options)
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    if protocol in ("file", "local"):
        return _open_local(url, path), True
    if size == 0:  # nothing to read: no request at all
        return io.BytesIO(b""), True
    kw: dict[str, Any] = {}
    if size is not None and protocol in _SIZED_OPEN and "::" not in url:
        kw["size"] = int(size)
    f = fs.open(path, "rb", block_size=8 * 2**20, cache_type="readahead", **kw)
    if kw and getattr(f, "_details", False) is None:
        # fsspec's buffered files (s3fs, gcsfs) look their details up on first read (a
        # second HEAD) to check the ETag of every read: hand them what the stat found
        details: dict[str, Any] = {"name": path, "size": int(size), "type": "file"}  # type: ignore[arg-type]
        if stamp and stamp.startswith("ETag="):
            details["ETag"] = stamp[len("ETag="):]
        f._details = details
    return Hashed(f), False


class Hashed:
    """A stream read through once, hashed as it is read (blake2b, 16 bytes).

    :meth:`content` reads what the scan left (the archive's trailing blocks) and gives
    ``"blake2b=<hex>"`` of every byte of the object; a stream that was moved about in
    (a seek elsewhere than where it stands) gives ``""``: its bytes were not all seen in order.
    """

    _CHUNK = 8 * 2**20

    def __init__(self, f: Any) -> None:
        self.f, self.pos, self.whole = f, 0, True
        self.hash = hashlib.blake2b(digest_size=16)

    def read(self, n: int = -1) -> bytes:
        data = self.f.read(n)
        self.hash.update(data)
        self.pos += len(data)
        return data  # type: ignore[no-any-return]

    def readinto(self, buf: Any) -> int:
        with memoryview(buf) as mv:
            data = self.f.read(len(mv))
            mv[:len(data)] = data
        self.hash.update(data)
        self.pos += len(data)
        return len(data)

    def seek(self, offset: int, whence: int = 0) -> int:
        now = self.f.seek(offset, whence)
        if now != self.pos:
            self.whole = False
        self.pos = now
        return now  # type: ignore[no-any-return]

    def tell(self) -> int:
        return self.pos

    def seekable(self) -> bool:
        return False

    def close(self) -> None:
        self.f.close()

    def __enter__(self) -> Hashed:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def content(self) -> str:
        """The identity of the object's bytes, read to its end; ``""`` if not all seen in order."""
        if not self.whole:
            return ""
        while True:
            data = self.f.read(self._CHUNK)
            if not data:
                break
            self.hash.update(data)
            self.pos += len(data)
        return f"blake2b={self.hash.hexdigest()}"


def content_of(f: Any) -> str:
    """The content identity of a stream a scan read (:class:`Hashed`), else ``""``."""
    return f.content() if isinstance(f, Hashed) else ""


def _open_local(url: str, path: str) -> Any:
    """``path`` opened unbuffered; running out of descriptors is the limit's error."""
    try:
        return open(path, "rb", buffering=0)
    except OSError as exc:
        if runs_out(exc):
            raise out_of_descriptors(f"cannot open shard {redact(url)!r} to scan it", exc,
                                     fewer="--workers (Python: build_index(..., workers=))") from exc
        raise


_NAMED = 4  # missing shards named besides the first


def stat_first(shard_urls: Sequence[str], workers: int, on_error: str, storage_options: Mapping[str, Any] | None,
                stats: Mapping[str, Stat] | None) -> dict[str, Stat]:
    """Every shard's stat before any is scanned (``workers`` at a time; those in ``stats``
    are not asked again): with ``on_error="raise"``, missing or unreadable shards are one
    error now, not after the scan of the others, saying how many and naming the first in
    URL order. The scan then asks for none of them again."""
    known = dict(stats or {})
    todo = [u for u in shard_urls if u not in known]
    faults = []
    for url, st in zip(todo, stat_shards(todo, workers, storage_options)):
        if isinstance(st, ShardError):
            faults.append((url, st))
        else:
            known[url] = st
    if faults and on_error != "skip":
        raise missing_shards(faults, len(shard_urls))
    return known  # a failed shard is not in it: its scan reports it, per on_error


def missing_shards(faults: Sequence[tuple[str, ShardError]], total: int) -> ShardError:
    """One error for the shards that cannot be stat-ed: how many of ``total``, the first
    (in URL order) with its own message, a few others by name, and the fix."""
    n = len(faults)
    if total == 1:
        return faults[0][1]
    what = "missing" if all(is_missing(e) for _, e in faults) else "missing or unreadable"
    head = (f"all {n} shards are" if n == total else f"{n} of {total} shards {'is' if n == 1 else 'are'}") + f" {what}"
    skip = "" if n == total else f"; or index with on_error='skip' to leave {'it' if n == 1 else 'them'} out"
    first = str(faults[0][1])
    if n == 1:
        return ShardError(f"{head}: {first}{skip}")
    others = ", ".join(repr(redact(u)) for u, _ in faults[1:1 + _NAMED])
    more = f" and {n - 1 - _NAMED} more" if n - 1 > _NAMED else ""
    return ShardError(f"{head}, e.g. the first in URL order: {first} (also: {others}{more}){skip}")
