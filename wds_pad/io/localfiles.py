"""Local shard files: cached descriptors, and the fast path that reads them inline.

The local half of :class:`~wds_pad.io.ranges.RangeReader` (a mixin it inherits): while
every range of a stream is a local file, ``read_many`` runs :meth:`_LocalFiles._read_local`
and nothing else.

Invariants:
    * Local files are read inline with ``os.pread`` on cached descriptors: no threads, no
      fsspec call per read, a few microseconds per range.
    * A reader keeps at most ``_MAX_OPEN_FDS`` descriptors (a quarter of the soft limit,
      256 to 4096); past it the oldest one no read-ahead thread is reading from is closed.
      A descriptor pinned in ``_busy`` (:mod:`wds_pad.io.readahead`) is never evicted.
    * A shard listed in the reader's ``expected`` is checked once, by one ``fstat`` when
      its descriptor is opened (:mod:`wds_pad.io.stale`); a changed one is closed again
      and raises :class:`StaleShardError`. A short read raises it too.
    * A malformed range is a :class:`ConfigError` naming it; the fast path checks a
      range's form only when it first meets its URL, or when a read fails.
    * The fast path returns the first range it cannot read inline (not a local file),
      checked, for the in-flight reader (:mod:`wds_pad.io.inflight`) to continue from.
"""

from __future__ import annotations

import operator
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from wds_pad.errors import ConfigError, ReadError, ShardError, StaleShardError

from .faults import _cause
from .options import ReadStats
from .redact import redact
from .stale import _short_read, _ShardCheck

if TYPE_CHECKING:
    from .remote import _Target


def _fd_budget() -> int:
    """Shard descriptors a reader keeps open: a quarter of the soft limit, 256 to 4096."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):
        return 256
    return 4096 if soft == resource.RLIM_INFINITY else max(256, min(4096, soft // 4))


_MAX_OPEN_FDS = _fd_budget()


def _check_range(rng: Any) -> tuple[str, int, int]:
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


def _close_fds(fds: dict[str, int]) -> None:
    for fd in fds.values():
        try:
            os.close(fd)
        except OSError:
            pass
    fds.clear()


class _LocalFiles:
    """The descriptors of local shards and the inline fast path (see the module invariants).

    Mixed into :class:`~wds_pad.io.ranges.RangeReader`, which owns the state below.
    """

    stats: ReadStats
    _check: _ShardCheck
    _fds: dict[str, int]  # shard URL -> its open descriptor
    _busy: dict[int, int]  # descriptor -> reads in flight on read-ahead threads

    if TYPE_CHECKING:
        def _target(self, url: str) -> _Target: ...

        def is_local(self, url: str) -> bool: ...

    def _fd(self, url: str, offset: int) -> int:
        fd = self._fds.get(url)
        if fd is None:
            path = self._target(url).path
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError as exc:
                raise ShardError(f"cannot open shard {redact(url)!r} to read byte offset "
                                 f"{offset}: {_cause(exc, 0)}; check the path, or rebuild the "
                                 "index if shards moved") from exc
            verdict = self._check.local(url, fd)
            if verdict is not None:
                os.close(fd)
                raise StaleShardError(verdict)
            if len(self._fds) >= _MAX_OPEN_FDS:
                # the oldest descriptor no read-ahead thread is reading from
                idle = next((u for u, d in self._fds.items() if d not in self._busy), None)
                if idle is not None:
                    os.close(self._fds.pop(idle))
            self._fds[url] = fd
        return fd

    def _pread(self, url: str, offset: int, length: int) -> bytes:
        try:
            return os.pread(self._fd(url, offset), length, offset)
        except OSError as exc:
            raise ReadError(f"reading {length} bytes at byte offset {offset} of "
                            f"{redact(url)!r} failed: {_cause(exc, 0)}; check the disk") from exc

    def _read_local(self, it: Iterator[Any]) -> Iterator[bytes]:
        """Fast path while every range is local: inline pread; returns the first other."""
        fds, pread, count, nbytes = self._fds, os.pread, 0, 0
        try:
            for rng in it:
                try:
                    url, offset, length = rng
                    fd = fds.get(url)
                except (TypeError, ValueError):
                    _check_range(rng)
                    raise
                if fd is None:
                    url, offset, length = _check_range(rng)
                    if not self.is_local(url):
                        return (url, offset, length)
                    fd = self._fd(url, offset)
                try:
                    data = pread(fd, length, offset)
                except (OSError, ValueError, TypeError, OverflowError):
                    _check_range(rng)
                    data = self._pread(url, offset, length)
                if len(data) != length:
                    raise _short_read(url, offset, length, len(data))
                count += 1
                nbytes += length
                yield data
            return None
        finally:
            st = self.stats
            st.ranges += count
            st.requests += count
            st.bytes += nbytes
