"""The general tar parser: one :class:`ScannedSample` per webdataset sample, and back.

``scan_tar`` walks a shard's headers (seeking past payloads when the file can seek,
reading through in 1 MiB chunks when it cannot) and yields one :class:`ScannedSample`
per webdataset sample; ``parse_sample`` turns the bytes of one recorded range back into
the sample's ``{ext: payload}``. The reading and grouping rules live in
:mod:`.headers` and :mod:`.members`, shared with the indexer's lean path (:mod:`.lean`).

Invariants:
    * ``scan_tar`` yields what ``wds.WebDataset(url)`` groups, in archive order, each
      sample with the contiguous byte range that holds it (see :mod:`.members`); seek
      mode and stream mode yield identical samples.
    * With ``on_error="skip"`` a fault stops the shard: the samples before it have been
      yielded, one warning is logged on this module's logger, and the generator returns
      the :class:`TarFormatError`.
    * ``parse_sample`` accepts exactly one sample's recorded range; any difference from
      what was indexed is a :class:`StaleShardError`, never a silently different sample.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterator
from typing import BinaryIO

from ..errors import StaleShardError, TarFormatError

from .headers import HINT, REINDEX, read_entry
from .reader import FdFile, Reader
from .members import KEY_RE, Member, OnError, ScannedSample, check_options, is_meta, read_samples, split_key

__all__ = ["Member", "OnError", "ScannedSample", "parse_sample", "parse_sample_at", "scan_tar", "split_key"]

_log = logging.getLogger(__name__)


def scan_tar(
    f: BinaryIO,
    url: str,
    *,
    want: Collection[str] = (),
    head_bytes: int | None = None,
    seekable: bool | None = None,
    on_error: str | OnError = "raise",
) -> Iterator[ScannedSample]:
    """Yield the webdataset samples of one tar shard with their byte ranges.

    Args:
        f: A binary file object (local file, fsspec file, streaming HTTP body) whose
            offset 0 (seek mode) or current position (stream mode) starts the archive.
        url: The shard's URL, for error messages.
        want: Extensions (webdataset suffixes such as ``"json"``) whose payloads go into
            ``ScannedSample.data``; others are skipped without reading when ``f`` seeks.
        head_bytes: Read only this many leading bytes of each wanted payload.
        seekable: Seek past payloads (True) or read through the file (False); ``None``
            asks ``f.seekable()``. Both modes yield identical samples.
        on_error: ``"raise"``: raise on the first fault. ``"skip"``: on a fault (corrupt,
            truncated or non-tar data, duplicate suffix) stop the shard there: the samples
            completed before the fault have been yielded, the sample in progress is
            dropped, a warning is logged, and the generator returns the
            :class:`TarFormatError` (``err = yield from scan_tar(...)``) so the caller can
            record the shard as skipped; it returns ``None`` after a clean scan.

    Yields:
        One :class:`ScannedSample` per sample, in archive order.

    Raises:
        TarFormatError: The shard is not a valid tar archive for webdataset (with
            ``on_error="raise"``); the message names the URL, byte offset and member.
        ShardError: Reading ``f`` failed.
        ConfigError: An argument is invalid.
    """
    wanted, head, mode = check_options(want, head_bytes, on_error)
    return _scan(f, url, wanted, head, seekable, mode)


def _scan(f: BinaryIO, url: str, want: frozenset[str], head: int | None, seekable: bool | None,
          mode: OnError) -> Iterator[ScannedSample]:
    if seekable is None:
        seekable = bool(getattr(f, "seekable", lambda: False)())
    try:
        r = Reader(f, url, seekable)
        yield from read_samples(r, want, head)
    except TarFormatError as exc:
        if mode is OnError.RAISE:
            raise
        _log.warning("skipping the rest of shard: %s", exc)
        return exc
    return None


def parse_sample(data: bytes, url: str, offset: int, key: str | None = None) -> dict[str, bytes]:
    """Parse one sample's byte range, as recorded by ``scan_tar``, into ``{ext: payload}``.

    Args:
        data: The bytes ``[offset, offset + length)`` of the shard.
        url: The shard's URL, for error messages.
        offset: Where ``data`` starts in the shard, for error messages.
        key: The expected ``__key__``; ``None`` accepts any single key.

    Returns:
        Every member's payload keyed by its webdataset suffix.

    Raises:
        StaleShardError: The bytes are not that sample: a header is invalid, a payload
            runs past the range, the range holds another key or more than one, or a
            suffix repeats. The shard changed since it was indexed; re-index it (the
            message gives the command).
    """
    if not isinstance(data, bytes):
        data = bytes(data)
    return _parse_range(Reader(None, url, True, data), url, 0, len(data), offset, key)


def parse_sample_at(fd: int, url: str, offset: int, length: int, key: str | None = None) -> dict[str, bytes]:
    """Like :func:`parse_sample`, reading the range ``[offset, offset + length)`` of a local file.

    Headers are read in small windows and each payload of 4 KiB or more with its own
    ``os.pread``, so a large member reaches the caller without being copied out of a
    larger buffer (at ~500 KB per sample that copy costs as much as the read).

    Raises:
        StaleShardError: as :func:`parse_sample` (also when the file is now shorter).
    """
    return _parse_range(Reader(FdFile(fd), url, True), url, offset, offset + length, 0, key)  # type: ignore[arg-type]


def _parse_range(r: Reader, url: str, start: int, end: int, base: int, key: str | None) -> dict[str, bytes]:
    """Members of the one sample in ``[start, end)`` of ``r``; ``base`` shifts offsets in messages."""
    out: dict[str, bytes] = {}
    pos, got, e = start, None, None
    try:
        while pos < end:
            e = read_entry(r, pos, e)
            if e is None:
                raise ValueError(f"end-of-archive block at offset {base + pos}")
            _, off, size, pos, name, regular = e
            if pos > end:
                raise ValueError(f"member {name!r} runs past the end of the range")
            if not regular or (name.startswith("__") and is_meta(name)):
                continue
            m = KEY_RE.match(name)
            if m is None:
                continue
            k, ext = m.group(1), m.group(2).lower()
            if got is None:
                got = k
            if k != got or (key is not None and k != key) or ext in out:
                raise ValueError(f"member {name!r} does not belong to sample {key or got!r}")
            payload = r.at(off, size)
            if len(payload) < size:
                raise ValueError(f"member {name!r} is cut short")
            out[ext] = payload
        if pos != end or got is None:
            raise ValueError(f"range of {end - start} bytes does not end where its last member ends ({pos - start})")
    except (TarFormatError, ValueError) as exc:
        detail = str(exc).removesuffix(f"; {HINT}").removeprefix(f"{url}: ")
        where = "offsets relative to the range" if base else "absolute offsets"
        raise StaleShardError(
            f"{url}: the {end - start} bytes at offset {base + start} are not sample {key!r} as indexed "
            f"({detail}; {where}); the shard changed since it was indexed, " + REINDEX.format(url=url)
        ) from exc
    return out
