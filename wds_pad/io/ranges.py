"""Byte-range reads over any fsspec filesystem: concurrent, in order, bounded, retried.

Every streaming stage reads samples through :class:`RangeReader`. A sample is one
contiguous byte range ``(url, offset, length)`` recorded by the tar index.

Invariants:
    * ``read_many`` yields exactly one ``bytes`` per input range, in input order, each
      exactly ``length`` long; a shorter answer raises :class:`StaleShardError`.
    * At most ``max_in_flight`` requests are outstanding, and the bytes buffered by the
      reader (requested but not yet handed out) never exceed
      ``max(max_bytes_in_flight, largest single range)`` — so peak buffered bytes are at
      most ``max_bytes_in_flight`` plus one largest sample.
    * Local files are read inline with ``os.pread`` on cached descriptors: no threads, no
      fsspec call per read, a few microseconds per range.
    * Large local samples may instead be read (and parsed) ahead by ``local_threads``
      threads (:meth:`RangeReader.local_read_ahead`, :mod:`wds_pad.io.readahead`), within
      the same bounds. A descriptor in use by such a thread is never evicted from the cache.
    * Remote reads run as coroutines on fsspec's IO loop: async filesystems (s3fs,
      HTTP) natively, sync ones through a thread pool. Every attempt has a timeout;
      transient failures are retried with exponential backoff whose jitter derives from
      (url, offset, attempt), never the clock (:mod:`wds_pad.io.remote`); permanent ones
      fail at once.
    * Filesystems, descriptors and pools belong to one process: after ``os.fork`` they
      are made anew (checked with ``os.getpid()``).
    * No message or log line carries a credential: all pass through :func:`redact`.
    * A failed range (or a closed iterator) cancels every request in flight; an error a
      cancelled one still ends in is retrieved, so asyncio prints nothing: the caller
      sees one error.
    * A failed attempt is judged as every store fault is (:mod:`wds_pad.io.faults`).
    * Given the indexed ``(size, stamp)`` of each shard (``expected``), a reader checks a
      shard once, when it first opens it, without an extra request
      (:mod:`wds_pad.io.stale`); a shard that differs raises :class:`StaleShardError`
      for every range of it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import operator
import os
import tempfile
import threading
import weakref
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import fsspec.asyn

from wds_pad.errors import ConfigError, ReadError, ShardError, StaleShardError, WdsPadError

from .faults import _attempt_error, _cause, _chain, _retries_exhausted, call_store
from .fs import get_filesystem
from .options import ReadOptions, ReadStats
from .readahead import LocalReadAhead
from .shardcache import PlannedShard, ShardCache
from .redact import redact
from .remote import _backoff, _Target, _watched
from .stale import _short_read, _ShardCheck, change_stamp

# the reader's API, and the names the old module held (the alias wds_pad.read leads here;
# they live in wds_pad.io.faults, .fs, .options, .readahead, .redact and .stale)
__all__ = ["LocalReadAhead", "RangeReader", "ReadOptions", "ReadStats", "call_store", "change_stamp",
           "get_filesystem", "redact"]

logger = logging.getLogger(__name__)

def _fd_budget() -> int:
    """Shard descriptors a reader keeps open: a quarter of the soft limit, 256 to 4096."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):
        return 256
    return 4096 if soft == resource.RLIM_INFINITY else max(256, min(4096, soft // 4))


_MAX_OPEN_FDS = _fd_budget()


class _Request:
    """One fetch serving one or more consecutive input ranges of one URL."""

    __slots__ = ("url", "target", "start", "end", "parts", "future", "data", "cached")

    def __init__(self, url: str, target: _Target, offset: int, length: int) -> None:
        self.url, self.target = url, target
        self.start, self.end = offset, offset + length
        self.parts = [(offset, length)]
        self.future: concurrent.futures.Future[bytes] | None = None
        self.data: bytes | None = None
        self.cached = False  # served by the reader's ShardCache

    def merge(self, url: str, offset: int, length: int, gap: int, cap: int) -> bool:
        end = max(self.end, offset + length)
        if url != self.url or not self.start <= offset <= self.end + gap \
                or end - self.start > cap:
            return False
        self.end = end
        self.parts.append((offset, length))
        return True


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


class RangeReader:
    """Reads byte ranges from any fsspec filesystem, concurrently and in order.

    One reader per process or DataLoader worker; it pickles as its options, and after
    ``os.fork`` rebuilds its descriptors, pool and filesystems on first use. Several
    ``read_many`` iterators may be interleaved in one thread; a reader is not meant to be
    shared by threads (give each thread its own).

    Args:
        options: How to read; defaults to ``ReadOptions()``.
        expected: The indexed ``(size, change stamp)`` of shard URLs (the index's
            ``ShardInfo``). Each listed shard is checked once, when first opened (see
            :mod:`wds_pad.io.stale`); a shard that changed raises :class:`StaleShardError`.
            None (or a URL not listed): no check beyond short reads.
    """

    def __init__(self, options: ReadOptions | None = None, *,
                 expected: Mapping[str, tuple[int, str]] | None = None) -> None:
        self.options = options if options is not None else ReadOptions()
        if not isinstance(self.options, ReadOptions):
            raise ConfigError(f"options must be a ReadOptions, got {type(options).__name__}")
        self.expected = expected
        self._check = _ShardCheck(expected)  # one check per listed shard, when first opened
        self.stats = ReadStats()
        self._stats_lock = threading.Lock()
        self._pid = os.getpid()
        self._targets: dict[str, _Target] = {}
        self._fds: dict[str, int] = {}  # never replaced: the finalizer closes what it holds
        self._busy: dict[int, int] = {}  # descriptor -> reads in flight on read-ahead threads
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._cache: ShardCache | None = None
        # a reader per stream is common (BucketedWebDataset makes one per iteration): its
        # descriptors must not outlive it, or every epoch leaks one per shard
        weakref.finalize(self, _close_fds, self._fds)

    def __getstate__(self) -> dict[str, Any]:
        return {"options": self.options, "expected": self.expected}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["options"], expected=state.get("expected"))  # type: ignore[misc]

    def __enter__(self) -> RangeReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Closes cached file descriptors and the thread pool (the reader stays usable).

        Also done when the reader is garbage collected (descriptors only).
        """
        if self._pid == os.getpid() and self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        _close_fds(self._fds)  # after a fork: the child's inherited copies
        self._targets, self._pool, self._busy = {}, None, {}
        self._pid = os.getpid()

    def _check_fork(self) -> None:
        if self._pid != os.getpid():
            self._cache = None  # the parent's: its futures and threads are not ours
            self.close()

    def local_fd(self, url: str) -> int | None:
        """The cached read-only descriptor of a local shard; None on other filesystems.

        Raises:
            ShardError: the local file cannot be opened.
        """
        self._check_fork()
        if not self.is_local(url):
            return None
        return self._fd(url, 0)

    def is_local(self, url: str) -> bool:
        """Whether this reader reads ``url`` with ``os.pread`` (fsspec resolves it, with
        these ``storage_options``, to its local filesystem).

        The filesystem decides, so ``local://`` paths count too;
        :func:`wds_pad.io.urls.is_local` answers from the URL alone, without one.

        Raises:
            ConfigError, ReadError, ShardError: as :func:`get_filesystem`.
        """
        return self._target(url).local

    def _target(self, url: str) -> _Target:
        target = self._targets.get(url)
        if target is None:
            target = self._targets[url] = _Target(
                *get_filesystem(url, self.options.storage_options))
        return target

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

    def local_read_ahead(self) -> LocalReadAhead:
        """A read-ahead of large local ranges for one stream (see :class:`LocalReadAhead`)."""
        return LocalReadAhead(self, self.options.local_threads)

    def _pread(self, url: str, offset: int, length: int) -> bytes:
        try:
            return os.pread(self._fd(url, offset), length, offset)
        except OSError as exc:
            raise ReadError(f"reading {length} bytes at byte offset {offset} of "
                            f"{redact(url)!r} failed: {_cause(exc, 0)}; check the disk") from exc

    def read(self, url: str, offset: int, length: int) -> bytes:
        """Reads one byte range.

        Raises:
            ShardError: The shard is missing or forbidden (no retries).
            StaleShardError: The shard is shorter than the range (it changed).
            ReadError: Transient failures outlasted ``retries`` or a timeout.
        """
        it = self.read_many(((url, offset, length),))
        try:
            return next(it)
        finally:
            it.close()

    def read_many(self, ranges: Iterable[tuple[str, int, int]]) -> Iterator[bytes]:
        """Yields the bytes of each range in input order, reading ahead concurrently.

        Consecutive ranges of one URL within ``merge_gap`` are fetched as one request
        and sliced. Up to ``max_in_flight`` requests and ``max_bytes_in_flight`` bytes are
        kept ahead of the consumer. Closing the iterator cancels what is in flight.

        Args:
            ranges: ``(url, offset, length)`` triples, e.g. from the tar index.

        Yields:
            Exactly ``length`` bytes per range.

        Raises:
            ShardError, StaleShardError, ReadError: As for :meth:`read`, after every
                earlier range was yielded.
        """
        self._check_fork()
        it = iter(ranges)
        first = yield from self._read_local(it)
        if first is not None:
            yield from self._read_general(it, first)

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

    def _pool_for_sync(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                self.options.max_in_flight, thread_name_prefix="wds_pad-read")
        return self._pool

    def follow(self, schedule: Iterator[list[PlannedShard]], worker: tuple[int, int] = (0, 1),
               max_shards: int | None = None) -> None:
        """Reads the remote shards of ``schedule`` whole, through a :class:`ShardCache`.

        Args:
            schedule: per epoch, the stream's planned shards in order of first use
                (``wds_pad.stream.stages.shard_schedule``).
            worker: (worker id, workers) of this process on its rank. With several
                workers and no ``cache_dir`` the shards go to a folder in the temporary
                directory named after the workers' parent process, so each is fetched
                once per rank.
            max_shards: shards held at once at most (the plan's window + 1), besides
                the one a read needs.
        """
        self._check_fork()
        opts = self.options
        cache_dir = opts.cache_dir
        in_worker = _in_dataloader_worker()
        if cache_dir is None and worker[1] > 1:
            cache_dir = os.path.join(tempfile.gettempdir(), f"wds_pad-shards-{os.getppid()}")
            _sweep_dead_folders(tempfile.gettempdir())
        if self._cache is not None:
            self._cache.close()
        self._cache = ShardCache(self._get_block, schedule, block_bytes=opts.block_bytes,
                                 cache_bytes=opts.cache_bytes, cache_dir=cache_dir, worker=worker[0],
                                 max_shards=max_shards, owner=os.getppid() if in_worker else os.getpid())

    @property
    def shard_cache(self) -> ShardCache | None:
        """The cache of :meth:`follow`, or None."""
        return self._cache

    def _get_block(self, url: str, start: int, length: int) -> concurrent.futures.Future[bytes]:
        """One ranged GET of a shard's block (retried, timed, stale-checked like any)."""
        target = self._target(url)
        with self._stats_lock:
            self.stats.requests += 1
            self.stats.bytes += length
            self.stats.shard_blocks += 1
        pool = None if target.is_async else self._pool_for_sync()
        loop = target.loop or fsspec.asyn.get_loop()
        return asyncio.run_coroutine_threadsafe(self._fetch(target, pool, url, start, length, 1), loop)

    def _submit(self, req: _Request) -> None:
        target, st, length = req.target, self.stats, req.end - req.start
        if req.cached:
            cache = self._cache
            req.future = cache.read(req.url, req.start, length, len(req.parts))  # type: ignore[union-attr]
            st.peak_cache_bytes = max(st.peak_cache_bytes, cache.peak_bytes)  # type: ignore[union-attr]
            return
        st.requests += 1
        if length == 0:
            req.data = b""
        elif target.local:
            req.data = self._pread(req.url, req.start, length)
        else:
            pool = None if target.is_async else self._pool_for_sync()
            loop = target.loop or fsspec.asyn.get_loop()
            req.future = asyncio.run_coroutine_threadsafe(
                self._fetch(target, pool, req.url, req.start, length, len(req.parts)), loop)

    async def _fetch(self, target: _Target, pool: concurrent.futures.Executor | None,
                     url: str, start: int, length: int, nparts: int) -> bytes:
        opts, attempt = self.options, 0
        _watched(asyncio.current_task())  # cancelled by a consumer gone, it may still fail
        what = f"{length} bytes at byte offset {start} of {redact(url)!r}" + (
            f" (one request for {nparts} merged ranges)" if nparts > 1 else "")
        while True:
            attempt += 1
            try:
                if pool is None:
                    call = self._check.get(target, url, start, start + length)
                else:
                    call = asyncio.get_running_loop().run_in_executor(pool, functools.partial(
                        target.fs.cat_file, target.path, start=start, end=start + length))
                return await asyncio.wait_for(_watched(call), opts.timeout)
            except WdsPadError:
                raise
            except Exception as exc:  # noqa: BLE001 - judged below, raised as ours
                failure: BaseException = exc
            # Raised outside the except clause so no __context__ holds an unredacted text.
            error = self._judge(failure, what, attempt, url)
            if error is not None:
                raise error from _chain(failure)
            delay = _backoff(opts, url, start, attempt)
            logger.info("retrying %s in %.2f s after %s", what, delay,
                        _cause(failure, opts.timeout))
            await asyncio.sleep(delay)

    def _judge(self, exc: BaseException, what: str, attempt: int, url: str = "",
               ) -> Exception | None:
        """Returns the error to raise for a failed attempt, or None to retry it."""
        opts = self.options
        error = _attempt_error(exc, what, url, opts.timeout)
        if error is not None:
            return error
        with self._stats_lock:
            self.stats.timeouts += isinstance(exc, TimeoutError)
            if attempt <= opts.retries:
                self.stats.retries += 1
                return None
        return _retries_exhausted(exc, what, attempt, url, opts.timeout, opts.retries)

    def _read_general(self, it: Iterator[Any], nxt: tuple[str, int, int] | None,
                      ) -> Iterator[bytes]:
        """Read-ahead loop for remote (or mixed) streams; see the module invariants."""
        opts, st, cache = self.options, self.stats, self._cache
        cap = min(opts.max_merged_bytes, opts.max_bytes_in_flight)
        gap, max_n, max_b = opts.merge_gap, opts.max_in_flight, opts.max_bytes_in_flight
        guard = (opts.retries + 1) * (opts.timeout + opts.backoff_max) + 30.0
        pending: deque[_Request] = deque()
        held: _Request | None = None  # being merged, not yet submitted
        inflight, exhausted = 0, False

        def fits(req: _Request) -> bool:
            return not pending or (len(pending) < max_n
                                   and inflight + req.end - req.start <= max_b)

        def submit(req: _Request) -> None:
            nonlocal inflight
            self._submit(req)
            pending.append(req)
            inflight += req.end - req.start
            st.peak_bytes_in_flight = max(st.peak_bytes_in_flight, inflight)
            st.peak_requests_in_flight = max(st.peak_requests_in_flight, len(pending))

        try:
            while True:
                while True:
                    if nxt is None and not exhausted:
                        try:
                            nxt = _check_range(next(it))
                        except StopIteration:
                            exhausted = True
                    if nxt is None:
                        if held is not None and fits(held):
                            submit(held)
                            held = None
                        break
                    if held is not None and not (cache is not None and cache.lists(held.url)) \
                            and held.merge(*nxt, gap, cap):
                        st.merged += 1
                        nxt = None
                        continue
                    if held is not None:
                        if not fits(held):
                            break
                        submit(held)
                    held, nxt = _Request(nxt[0], self._target(nxt[0]), nxt[1], nxt[2]), None
                    if cache is not None and not held.target.local and cache.planned(held.url):
                        held.cached = True
                if not pending:
                    if held is None:
                        return
                    submit(held)
                    held = None
                head = pending[0]
                data = head.data
                if data is None and head.future is not None:
                    try:
                        data = head.future.result(timeout=guard)
                    except concurrent.futures.TimeoutError:
                        raise ReadError(f"reading byte offset {head.start} of "
                                        f"{redact(head.url)!r} hung past {guard:.0f} s; the IO "
                                        "loop is blocked") from None
                size = head.end - head.start
                if len(data) != size:
                    if len(data) > size:
                        raise ReadError(f"{redact(head.url)!r} returned {len(data)} bytes for a "
                                        f"range of {size} at byte offset {head.start}: the "
                                        "server ignored the Range header")
                    for off, ln in head.parts:
                        if off + ln - head.start > len(data):
                            raise _short_read(head.url, off, ln,
                                              max(0, len(data) - (off - head.start)))
                if not head.cached:
                    st.bytes += size
                st.ranges += len(head.parts)
                if len(head.parts) == 1:
                    yield data
                else:
                    for off, ln in head.parts:
                        yield data[off - head.start:off - head.start + ln]
                pending.popleft()
                inflight -= size
        finally:
            for req in pending:
                if req.future is not None:
                    req.future.cancel()




def _in_dataloader_worker() -> bool:
    try:
        from torch.utils.data import get_worker_info
    except ImportError:  # pragma: no cover
        return False
    return get_worker_info() is not None


def _sweep_dead_folders(tmp: str) -> None:
    """Removes the default shard folders (``wds_pad-shards-<pid>`` in the temporary
    directory) of parent processes that are gone: what a crashed run left behind."""
    import shutil

    from .atomic import _alive

    try:
        names = os.listdir(tmp)
    except OSError:
        return
    for name in names:
        pid = name[len("wds_pad-shards-"):]
        if name.startswith("wds_pad-shards-") and pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(os.path.join(tmp, name), ignore_errors=True)
