"""One request to a remote store: where it goes, how its headers are kept, when it is
tried again.

Invariants:
    * A :class:`Target` is made once per shard URL and reader: its filesystem, path and
      whether a ranged GET can show its headers (s3fs, fsspec's HTTP) to the stale-shard
      check; other filesystems answer through ``_cat_file`` alone.
    * :func:`s3_get` and :func:`http_get` send exactly the request fsspec's own
      ``_cat_file`` sends for one range, and return its Content-Range and ETag too; a
      whole object is asked for over HTTP without a Range header, and a 200 answer's
      length stands for the object's size.
    * A retry waits :func:`backoff_delay`: exponential, capped, with jitter derived from
      (url, offset, attempt), never the clock.
    * A request whose consumer went away may still fail: :func:`watched_future` marks its
      error retrieved, so asyncio prints nothing.
"""

from __future__ import annotations

import asyncio
import sys
import zlib
from typing import Any

import fsspec
import fsspec.asyn
from fsspec.implementations.local import LocalFileSystem

from .options import ReadOptions


def backoff_delay(options: ReadOptions, url: str, offset: int, attempt: int) -> float:
    base = min(options.backoff * 2 ** (attempt - 1), options.backoff_max)
    jitter = zlib.crc32(f"{url}|{offset}|{attempt}".encode()) / 2**32
    return base * (0.5 + 0.5 * jitter)


class Target:
    """A shard's filesystem and path; ``get`` says how a ranged GET shows its headers:
    "s3" (s3fs), "http" (fsspec's aiohttp HTTPFileSystem) or "" (``_cat_file``, no headers)."""

    __slots__ = ("fs", "path", "local", "is_async", "loop", "get")

    def __init__(self, fs: fsspec.AbstractFileSystem, path: str) -> None:
        self.fs, self.path = fs, path
        self.local = isinstance(fs, LocalFileSystem)
        self.is_async = bool(getattr(fs, "async_impl", False)) and not self.local
        self.get = "" if self.local or not self.is_async else _get_kind(fs)
        self.loop = None
        if self.is_async:
            try:
                self.loop = fs.loop
            except (NotImplementedError, RuntimeError, AttributeError):
                self.loop = fsspec.asyn.get_loop()


def _get_kind(fs: fsspec.AbstractFileSystem) -> str:
    # the modules are loaded already when fs is one of theirs: nothing is imported here
    s3 = sys.modules.get("s3fs.core")
    if s3 is not None and isinstance(fs, s3.S3FileSystem) and hasattr(s3, "_error_wrapper"):
        return "s3"
    http = sys.modules.get("fsspec.implementations.http")
    if http is not None and isinstance(fs, http.HTTPFileSystem):
        return "http"
    return ""


def range_total_size(content_range: Any) -> int | None:
    """The object size of a Content-Range header (``bytes 0-99/12345``); None if unknown."""
    if not isinstance(content_range, str):
        return None
    total = content_range.rpartition("/")[2].strip()
    return int(total) if total.isdigit() else None


async def s3_get(fs: Any, path: str, start: int, end: int) -> tuple[bytes, Any, Any]:
    """s3fs's ``_cat_file`` for one range, keeping ContentRange and ETag of the response."""
    from s3fs.core import _error_wrapper

    bucket, key, version = fs.split_path(path)
    extra = {"VersionId": version} if version else {}

    async def call_and_read() -> tuple[bytes, Any, Any]:
        resp = await fs._call_s3("get_object", Bucket=bucket, Key=key,
                                 Range=f"bytes={start}-{end - 1}", **extra)
        try:
            data = await resp["Body"].read()
        finally:
            resp["Body"].close()
        return data, resp.get("ContentRange"), resp.get("ETag")

    return await _error_wrapper(call_and_read, retries=fs.retries)


async def http_get(fs: Any, url: str, start: int, end: int, whole: bool = False) -> tuple[bytes, Any, Any]:
    """fsspec HTTPFileSystem's ``_cat_file`` for one range, keeping Content-Range and ETag.

    ``whole``: the range is the whole object, asked for without a Range header (a server
    that ignores Range serves it all the same). A 200 answer carries the whole object,
    so its length is the object's size: it is returned as a Content-Range would say it.
    """
    kw = fs.kwargs.copy()
    headers = kw.pop("headers", {}).copy()
    if not whole:
        headers["Range"] = f"bytes={start}-{end - 1}"
    kw["headers"] = headers
    session = await fs.set_session()
    async with session.get(fs.encode_url(url), **kw) as r:
        data = await r.read()
        fs._raise_not_found_for_status(r, url)
        content_range = r.headers.get("Content-Range")
        if content_range is None and r.status == 200 and r.headers.get("Content-Encoding", "identity") == "identity":
            content_range = f"bytes 0-{len(data) - 1}/{len(data)}"
        return data, content_range, r.headers.get("ETag")


def _retrieve(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()  # seen: asyncio no longer prints it when the future is collected


def watched_future(aw: Any) -> Any:
    """``aw`` as a future whose failure counts as retrieved once it is done.

    A request whose consumer stopped (or failed on an earlier range) is cancelled, but it
    may still end in an error, racing the cancel; nobody is left to read that error, and
    asyncio would print each one as "Task exception was never retrieved" with its traceback.
    A consumer still waiting gets the error as before.
    """
    if aw is None:
        return None
    fut = asyncio.ensure_future(aw)
    fut.add_done_callback(_retrieve)
    return fut

