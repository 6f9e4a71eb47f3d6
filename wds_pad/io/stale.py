"""Is a shard still as indexed: its change stamp, and the check a reader makes of it.

Invariants:
    * :func:`change_stamp` is the one definition of a shard's version: the index records
      it (``shard_info``) and the reader compares against it.
    * A shard listed in the reader's ``expected`` is checked once, when first opened: a
      local file by one ``fstat`` (size, mtime), an S3 or HTTP object by the Content-Range
      total size and ETag of its first ranged GET response (no extra request). The
      verdict is kept: every later range of a changed shard raises
      :class:`StaleShardError`, a remote one without another request.
    * The size is compared when both are known; the stamp only when the index recorded
      one of the same kind (an ETag with an ETag, an mtime with an mtime).
    * A copy read instead of the store (the node cache) is checked by :meth:`ShardCheck.head`:
      one ``info`` call per listed shard, the same verdict and text.
    * Unlisted shards and other filesystems (chained caches, memory, ...) are not checked
      beyond the short-read test (:func:`short_read`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from wds_pad.errors import StaleShardError

from .faults import call_store
from .redact import redact
from .remote import Target, http_get, range_total_size, s3_get

__all__ = ["change_stamp"]

# the fields of an fsspec info dict that may stamp a shard's version, in order of trust
_STAMP_FIELDS = ("ETag", "etag", "checksum", "md5Hash", "crc32c", "mtime", "LastModified",
                 "last_modified", "updated", "created")


def change_stamp(info: Mapping[str, Any]) -> str:
    """A shard's change stamp, as the index records it: ``"<field>=<value>"``.

    The first of ETag, checksum, mtime, LastModified, ... that ``info`` (an fsspec info
    dict, or a dict of one field such as ``{"mtime": st.st_mtime}``) holds; ``""`` if none.

    Args:
        info: fsspec ``info()`` of the shard, or the fields a read response carried.

    Returns:
        The stamp; equal stamps of one kind (the part before ``=``) mean the same version.
    """
    for name in _STAMP_FIELDS:
        value = info.get(name)
        if value is not None and value != "":
            return f"{name}={value}"
    return ""


def short_read(url: str, offset: int, length: int, got: int) -> StaleShardError:
    return StaleShardError(
        f"shard {redact(url)!r} returned {got} of {length} bytes at byte offset {offset}: "
        "it changed or shrank since it was indexed; rebuild the index (wds-pad index)")


class ShardCheck:
    """The indexed ``(size, stamp)`` of shard URLs, and the verdict on each once known.

    A verdict is None (checked, unchanged) or the :class:`StaleShardError` message.
    """

    __slots__ = ("expected", "verdicts")

    def __init__(self, expected: Mapping[str, tuple[int, str]] | None) -> None:
        self.expected = expected
        self.verdicts: dict[str, str | None] = {}

    def changed(self, url: str, size: int | None, stamp: str) -> str | None:
        """None if the shard is as indexed (or unlisted), else the StaleShardError message."""
        want = self.expected.get(url) if self.expected is not None else None
        if want is None:
            return None
        want_size, want_stamp = want
        differs = size is not None and want_size >= 0 and size != want_size
        same_kind = bool(stamp) and stamp.partition("=")[0] == want_stamp.partition("=")[0]
        differs = differs or (same_kind and stamp != want_stamp)
        if not differs:
            return None
        now = f"{size} bytes" if size is not None else "size unknown"
        return (f"shard {redact(url)!r} changed since it was indexed: it now has {now}"
                f"{f', {stamp}' if same_kind else ''}, the index records {want_size} bytes"
                f"{f', {want_stamp}' if same_kind else ''}; its samples may no longer be at the "
                "indexed byte ranges. Re-index the changed shards: `wds-pad index SHARDS -o INDEX "
                "--update` (or restore the shard)")

    def local(self, url: str, fd: int) -> str | None:
        """The verdict on a local shard just opened as ``fd`` (one ``fstat``, the first time)."""
        if self.expected is not None and url not in self.verdicts:
            try:
                st = os.fstat(fd)
            except OSError:
                st = None  # unknowable: the reads themselves will tell
            if st is not None:
                self.verdicts[url] = self.changed(url, st.st_size,
                                                  change_stamp({"mtime": st.st_mtime}))
        return self.verdicts.get(url)

    def head(self, target: Target, url: str) -> bool:
        """Asks the store about a listed shard not checked yet (one ``info``: a HEAD over
        HTTP and S3, a stat elsewhere), for a copy read instead of the store; whether it
        asked. A changed shard raises :class:`StaleShardError` with the text a read of
        it gives.

        Raises:
            StaleShardError: the shard is not the indexed one.
            ShardError, ReadError: as :func:`~wds_pad.io.faults.call_store`.
        """
        asked = False
        if self.expected is not None and url in self.expected and url not in self.verdicts:
            info = call_store(lambda: target.fs.info(target.path), url)
            asked = True
            size = info.get("size")
            self.verdicts[url] = self.changed(url, int(size) if isinstance(size, int) else None,
                                              change_stamp(info))
        verdict = self.verdicts.get(url)
        if verdict is not None:
            raise StaleShardError(verdict)
        return asked

    async def get(self, target: Target, url: str, start: int, end: int) -> bytes:
        """One ranged GET; the first response of a listed S3/HTTP shard also checks it."""
        if self.expected is None or not target.get:
            return await target.fs._cat_file(target.path, start=start, end=end)
        if self.verdicts.get(url) is not None:  # known to have changed: no more requests
            raise StaleShardError(self.verdicts[url])
        want = self.expected.get(url)
        if target.get == "s3":
            data, content_range, etag = await s3_get(target.fs, target.path, start, end)
        else:  # a whole shard (locality="shard") is asked for without Range
            whole = start == 0 and want is not None and end == want[0]
            data, content_range, etag = await http_get(target.fs, target.path, start, end, whole)
        if url not in self.verdicts:  # the first answer decides; all run on one IO loop
            self.verdicts[url] = self.changed(url, range_total_size(content_range),
                                              change_stamp({"ETag": etag}))
        verdict = self.verdicts[url]
        if verdict is not None:
            raise StaleShardError(verdict)
        return data
