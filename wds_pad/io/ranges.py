"""Byte-range reads over any fsspec filesystem: concurrent, in order, bounded, retried.

Every streaming stage reads samples through :class:`RangeReader`. A sample is one
contiguous byte range ``(url, offset, length)`` recorded by the tar index. This module
is the reader's face: its options, lifecycle and the choice of path; the local files and
their fast path are in :mod:`wds_pad.io.localfiles`, the remote ranges in flight in
:mod:`wds_pad.io.inflight`, whole shards of a shard-local plan in
:mod:`wds_pad.io.shardcache` (one process's memory) or :mod:`wds_pad.io.nodecache` (one
copy per node).

Invariants:
    * ``read_many`` yields exactly one ``bytes`` per input range, in input order, each
      exactly ``length`` long; a shorter answer raises :class:`StaleShardError`.
    * At most ``max_in_flight`` requests are outstanding, and the bytes buffered by the
      reader (requested but not yet handed out) never exceed
      ``max(max_bytes_in_flight, largest single range)`` — so peak buffered bytes are at
      most ``max_bytes_in_flight`` plus one largest sample.
    * While every range is local, they are read inline with ``os.pread`` on cached
      descriptors (:mod:`wds_pad.io.localfiles`); from the first other range on, through
      the in-flight reader (:mod:`wds_pad.io.inflight`). Whether a URL is local is the
      reader's :meth:`RangeReader.is_local`: its filesystem decides.
    * Large local samples may instead be read (and parsed) ahead by ``local_threads``
      threads (:meth:`RangeReader.local_read_ahead`, :mod:`wds_pad.io.readahead`), within
      the same bounds. A descriptor in use by such a thread is never evicted from the cache.
    * Filesystems, descriptors and pools belong to one process: after ``os.fork`` they
      are made anew (checked with ``os.getpid()``).
    * No message or log line carries a credential: all pass through :func:`redact`.
    * Given the indexed ``(size, stamp)`` of each shard (``expected``), a reader checks a
      shard once, when it first opens it, without an extra request
      (:mod:`wds_pad.io.stale`); a shard that differs raises :class:`StaleShardError`
      for every range of it.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
import weakref
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from wds_pad.errors import ConfigError

from .descriptors import fd_budget
from .faults import call_store
from .fs import get_filesystem
from .inflight import InFlight
from .localfiles import close_fds, LocalFiles
from .options import ReadOptions, ReadStats
from .readahead import LocalReadAhead
from .nodecache import NodeCache
from .nodefolder import job_session
from .shardcache import PlannedShard, ShardCache
from .shardplan import NodeEpoch
from .redact import redact
from .remote import Target
from .stale import ShardCheck, change_stamp

# the reader's API, and the names the old module held (the alias wds_pad.read leads here;
# they live in wds_pad.io.faults, .fs, .options, .readahead, .redact and .stale)
__all__ = ["LocalReadAhead", "RangeReader", "ReadOptions", "ReadStats", "call_store", "change_stamp",
           "get_filesystem", "redact"]


class RangeReader(LocalFiles, InFlight):
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
        self._check = ShardCheck(expected)  # one check per listed shard, when first opened
        self.stats = ReadStats()
        self._stats_lock = threading.Lock()
        self._head_lock = threading.Lock()
        self._pid = os.getpid()
        self._targets: dict[str, Target] = {}
        self._fds: dict[str, int] = {}  # never replaced: the finalizer closes what it holds
        self._maps: dict[str, memoryview] = {}  # shard mappings while their descriptors are open
        self._unmapped: set[str] = set()  # ... and the shards not mapped
        self._busy: dict[int, int] = {}  # descriptor -> reads in flight on read-ahead threads
        self._fd_limit = fd_budget()  # a share of the soft RLIMIT_NOFILE, read now
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._cache: ShardCache | NodeCache | None = None
        # a reader per stream is common (BucketedWebDataset makes one per iteration): its
        # descriptors must not outlive it, or every epoch leaks one per shard
        weakref.finalize(self, close_fds, self._fds)

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
        close_fds(self._fds, self._maps, self._unmapped)  # after a fork: the child's inherited copies
        self._targets, self._pool, self._busy = {}, None, {}
        self._pid, self._fd_limit = os.getpid(), fd_budget()

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

    def _target(self, url: str) -> Target:
        target = self._targets.get(url)
        if target is None:
            target = self._targets[url] = Target(
                *get_filesystem(url, self.options.storage_options))
        return target

    def local_read_ahead(self) -> LocalReadAhead:
        """A read-ahead of large local ranges for one stream (see :class:`LocalReadAhead`)."""
        return LocalReadAhead(self, self.options.local_threads)

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

    def follow(self, schedule: Iterator[list[PlannedShard]] | Iterator[NodeEpoch], max_shards: int | None = None,
               folder: str | None = None) -> None:
        """Reads the remote shards of ``schedule`` whole: in this process's memory
        (:class:`ShardCache`), or through the node's copies in ``folder`` (:class:`NodeCache`).

        Args:
            schedule: per epoch, the stream's planned shards in order of first use
                (``wds_pad.stream.wholeshards.shard_schedule``); with ``folder``, what the node's
                plans say of the epoch (``wds_pad.stream.wholeshards.node_schedule``).
            max_shards: shards held at most in memory, besides the one a read needs (the
                plan's window + 1). With ``folder`` every shard of the schedule is fetched
                ahead, in order of first use, two at a time, within ``cache_bytes``.
            folder: the folder the node's processes share (``wds_pad.io.nodefolder``), or
                None: memory.
        """
        self._check_fork()
        opts = self.options
        if self._cache is not None:
            self._cache.close()
        if folder is None:
            self._cache = ShardCache(self._get_block, schedule, block_bytes=opts.block_bytes,  # type: ignore[arg-type]
                                     cache_bytes=opts.cache_bytes, max_shards=max_shards)
            return
        guard = (opts.retries + 1) * (opts.timeout + opts.backoff_max) + 30.0  # as a request in flight
        self._cache = NodeCache(self._get_block, schedule, folder=folder, block_bytes=opts.block_bytes,  # type: ignore[arg-type]
                                cache_bytes=opts.cache_bytes, depth=2, guard=guard,
                                check=self._check_store, session=job_session(), kept=opts.cache_dir is not None)

    def _check_store(self, url: str) -> None:
        """Asks the store whether ``url`` is still the indexed shard (once, counted), for a
        node's copy about to be read instead of it.

        Raises:
            StaleShardError: it is not (the text a read of it gives).
        """
        with self._head_lock:  # one HEAD per shard, whichever thread asks first
            asked = self._check.head(self._target(url), url)
        if asked:
            with self._stats_lock:
                self.stats.store_checks += 1

    @property
    def shard_cache(self) -> ShardCache | NodeCache | None:
        """The cache of :meth:`follow`, or None."""
        return self._cache
