"""One shard on its filesystem: its size and change stamp, and opening it for a scan.

Invariants:
- ``shard_info`` is the one definition of a shard's (size, change stamp) that build,
  update, verify and the shard-level stream compare; the stamp comes from
  ``wds_pad.io.stale.change_stamp``, the same function the range reader checks against;
- a plain absolute local path is stat-ed and opened with ``os`` calls only (no fsspec
  filesystem is built); any other URL goes through fsspec;
- a missing or unreadable shard is a ``ShardError`` naming the (redacted) URL; a store
  that cannot be reached is a ``ReadError`` (nothing is known about the shard);
- a local shard opens unbuffered and seekable (the scan seeks past payloads); a remote
  one opens as one read-ahead stream (the scan reads it through once).
"""

from __future__ import annotations

import os
from typing import Any, Mapping

from ..errors import ShardError
from ..io.faults import call_store
from ..io.fs import get_filesystem
from ..io.redact import redact
from ..io.stale import change_stamp as _stamp  # one definition: the reader checks against it

__all__ = ["directory_error", "not_a_prefix", "open_for_scan", "plain_local", "shard_info"]


def plain_local(url: str) -> bool:
    """An absolute local path without a protocol or chain: os calls need no fsspec."""
    return url.startswith("/") and "::" not in url


def shard_info(url: str, storage_options: Mapping[str, Any] | None = None) -> tuple[int, str]:
    """(size, change stamp) of one shard.

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
        if not os.path.isdir(url):
            return st.st_size, _stamp({"mtime": st.st_mtime})
    fs, path = get_filesystem(url, storage_options)
    info = call_store(lambda: fs.info(path), url)
    size = info.get("size")
    if size is None:
        raise ShardError(f"shard {redact(url)!r}: the filesystem reports no size")
    return int(size), _stamp(info)


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


def open_for_scan(url: str, storage_options: Mapping[str, Any] | None) -> tuple[Any, bool]:
    """(binary file, seekable): unbuffered local files, read-ahead streams elsewhere."""
    if plain_local(url):
        return open(url, "rb", buffering=0), True
    fs, path = get_filesystem(url, storage_options)
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    if protocol in ("file", "local"):
        return open(path, "rb", buffering=0), True
    return fs.open(path, "rb", block_size=8 * 2**20, cache_type="readahead"), False
