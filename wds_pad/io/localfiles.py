"""Local shard files: cached descriptors, and the fast path that reads them inline.

The local half of :class:`~wds_pad.io.ranges.RangeReader` (a mixin it inherits): while
every range of a stream is a local file, ``read_many`` runs :meth:`LocalFiles._read_local`
and nothing else.

Invariants:
    * Local files are read inline with ``os.pread`` on cached descriptors: no threads, no
      fsspec call per read, a few microseconds per range.
    * A reader keeps at most ``_fd_limit`` descriptors (:func:`~wds_pad.io.descriptors.fd_budget`:
      a quarter of the soft ``RLIMIT_NOFILE``, read when the reader is made or forked);
      past it the oldest one no read-ahead thread is reading from is closed. A descriptor
      pinned in ``_busy`` (:mod:`wds_pad.io.readahead`) is never evicted.
    * Opening a shard when the process has no descriptor left (``EMFILE``) closes every
      idle descriptor of the reader and tries once more; if that fails too, the error is
      the limit's (:func:`~wds_pad.io.descriptors.out_of_descriptors`), never the shard's.
    * A shard listed in the reader's ``expected`` is checked once, by one ``fstat`` when
      its descriptor is opened (:mod:`wds_pad.io.stale`); a changed one is closed again
      and raises :class:`StaleShardError`. A short read raises it too.
    * A malformed range is a :class:`ConfigError` naming it; the fast path checks a
      range's form only when it first meets its URL, or when a read fails.
    * The fast path returns the first range it cannot read inline (not a local file),
      checked, for the in-flight reader (:mod:`wds_pad.io.inflight`) to continue from.
    * :meth:`LocalFiles.local_map` gives the process's mapping of an open shard
      (:mod:`wds_pad.io.shardmaps`), for the batch path to copy samples out of; the reader
      holds it while it holds the shard's descriptor, and asks again after reopening it.
"""

from __future__ import annotations

import itertools
import operator
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from wds_pad.errors import ConfigError, ReadError, ShardError, StaleShardError

from .descriptors import out_of_descriptors, runs_out
from .faults import cause_text
from .options import ReadOptions, ReadStats
from .redact import redact
from .shardmaps import mapped, shrunk
from .stale import short_read, ShardCheck

if TYPE_CHECKING:
    from .remote import Target


def check_range(rng: Any) -> tuple[str, int, int]:
    try:
        url, offset, length = rng
        offset, length = operator.index(offset), operator.index(length)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"a range must be (url, offset, length) with int offset and "
                          f"length, got {redact(repr(rng))}") from exc
    if not isinstance(url, str):
        raise ConfigError(f"a range's URL must be a str, got {redact(repr(url))}")
    if offset < 0 or length < 0:
        raise ConfigError(f"range of {redact(str(url))!r} has a negative byte offset "
                          f"({offset}) or length ({length}); the index is damaged")
    return url, offset, length


def close_fds(fds: dict[str, int], maps: dict[str, Any] | None = None, unmapped: set[str] | None = None) -> None:
    for fd in fds.values():
        try:
            os.close(fd)
        except OSError:
            pass
    fds.clear()
    if maps is not None:
        maps.clear()
    if unmapped is not None:
        unmapped.clear()


class LocalFiles:
    """The descriptors of local shards and the inline fast path (see the module invariants).

    Mixed into :class:`~wds_pad.io.ranges.RangeReader`, which owns the state below.
    """

    stats: ReadStats
    options: ReadOptions
    _check: ShardCheck
    _fds: dict[str, int]  # shard URL -> its open descriptor
    _maps: dict[str, memoryview]  # shard URL -> its mapping (shardmaps), while its descriptor is open
    _unmapped: set[str]  # shards asked for and not mapped (shardmaps.mapped said None), while open
    _fd_limit: int  # descriptors kept at most (idle ones beyond it are closed)
    _busy: dict[int, int]  # descriptor -> reads in flight on read-ahead threads
    map_at_once = False  # map a shard on its first stream here (shardmaps.mapped's ``at_once``)

    if TYPE_CHECKING:
        def _target(self, url: str) -> Target: ...

        def is_local(self, url: str) -> bool: ...

    def _fd(self, url: str, offset: int) -> int:
        fd = self._fds.get(url)
        if fd is None:
            if len(self._fds) >= self._fd_limit:
                self._evict(len(self._fds) + 1 - self._fd_limit)
            fd = self._open(url, offset)
            verdict = self._check.local(url, fd)
            if verdict is not None:
                os.close(fd)
                raise StaleShardError(verdict)
            self._fds[url] = fd
            self._maps.pop(url, None)  # of the descriptor before: ask again (local_map)
            self._unmapped.discard(url)
        return fd

    def local_map(self, url: str) -> memoryview | None:
        """A read-only view of the mapping of the local shard ``url`` whose descriptor this
        reader holds open (and checked); None: not open, or not mappable (read it with
        ``os.pread``: the answer is kept while the descriptor is)."""
        view = self._maps.get(url)
        if view is not None or url in self._unmapped:
            return view
        fd = self._fds.get(url)
        if fd is None:
            return None
        view = mapped(self._target(url).path, fd, self.map_at_once) if self.options.map_local else None
        if view is None:
            self._unmapped.add(url)
        else:
            self._maps[url] = view
        return view

    def mapped_views(self, urls: list[str]) -> list[memoryview] | None:
        """Per range of ``urls`` (a batch's), the mapping of its shard to copy it out of, or
        None: a shard not open yet or not mapped, or shorter now than its mapping (read the
        batch with ``os.pread``, which says what changed). Maps the open shards it meets first."""
        maps = self._maps
        try:  # a lookup that fails: no comparison of views with None (a memoryview compares slowly)
            views = list(map(maps.__getitem__, urls))
        except KeyError:
            for url in set(urls).difference(maps, self._unmapped):
                self.local_map(url)
            try:
                views = list(map(maps.__getitem__, urls))
            except KeyError:
                return None
        return None if shrunk(self._fds, maps, set(urls)) else views

    def opened_views(self, urls: list[str], offsets: list[int]) -> list[memoryview] | None:
        """:meth:`mapped_views` of a batch whose shards this reader may not hold open yet:
        each one opened first (and checked against the index: ``StaleShardError``, or a
        ``ShardError`` naming it)."""
        fds = self._fds
        for url, offset in zip(urls, offsets):
            if url not in fds:
                self._fd(url, offset)
        return self.mapped_views(urls)

    def _evict(self, n: int) -> int:
        """Closes the ``n`` oldest descriptors no read-ahead thread is reading from; how many."""
        idle = list(itertools.islice((u for u, d in self._fds.items() if d not in self._busy), n))
        for u in idle:
            os.close(self._fds.pop(u))
            self._maps.pop(u, None)
            self._unmapped.discard(u)
        return len(idle)

    def _open(self, url: str, offset: int) -> int:
        path = self._target(url).path
        try:
            return os.open(path, os.O_RDONLY)
        except OSError as exc:
            error = exc
        # out of descriptors: close what this reader holds idle, then try once more
        if runs_out(error) and self._evict(len(self._fds)):
            try:
                return os.open(path, os.O_RDONLY)
            except OSError as exc:
                error = exc
        what = f"cannot open shard {redact(url)!r} to read byte offset {offset}"
        if runs_out(error):
            raise out_of_descriptors(what, error, held=len(self._fds),
                                     fewer="DataLoader workers or local_threads") from error
        raise ShardError(f"{what}: {cause_text(error, 0)}; check the path, or rebuild the index "
                         "if shards moved") from error

    def _pread(self, url: str, offset: int, length: int) -> bytes:
        try:
            return os.pread(self._fd(url, offset), length, offset)
        except OSError as exc:
            raise ReadError(f"reading {length} bytes at byte offset {offset} of "
                            f"{redact(url)!r} failed: {cause_text(exc, 0)}; check the disk") from exc

    def _read_local(self, it: Iterator[Any]) -> Iterator[bytes]:
        """Fast path while every range is local: inline pread; returns the first other."""
        fds, pread, count, nbytes = self._fds, os.pread, 0, 0
        try:
            for rng in it:
                try:
                    url, offset, length = rng
                    fd = fds.get(url)
                except (TypeError, ValueError):
                    check_range(rng)
                    raise
                if fd is None:
                    url, offset, length = check_range(rng)
                    if not self.is_local(url):
                        return (url, offset, length)
                    fd = self._fd(url, offset)
                try:
                    data = pread(fd, length, offset)
                except (OSError, ValueError, TypeError, OverflowError):
                    check_range(rng)
                    data = self._pread(url, offset, length)
                if len(data) != length:
                    raise short_read(url, offset, length, len(data))
                count += 1
                nbytes += length
                yield data
            return None
        finally:
            st = self.stats
            st.ranges += count
            st.requests += count
            st.bytes += nbytes
