"""Local read-ahead: large local ranges read (and parsed) by a few threads, in order.

The reader (:class:`~wds_pad.io.ranges.RangeReader`) makes one :class:`LocalReadAhead`
per stream; this module knows the reader only by what it uses of it (:class:`_Reader`),
so it never imports :mod:`wds_pad.io.ranges`.

Invariants:
    * Results come back in input order, one per item, each error with its own item.
    * What is read ahead stays within the reader's ``max_in_flight`` and
      ``max_bytes_in_flight`` (plus one largest item).
    * The threads belong to one stream: they start on first use in a process and stop
      when it is closed or collected; after ``os.fork`` the child starts its own.
    * A descriptor in use by such a thread is pinned in the reader's ``_busy`` and never
      evicted from its cache; no more shards are pinned at once than the cache may hold
      (its ``_fd_limit``, a share of the descriptor limit), besides the first item's.
"""

from __future__ import annotations

import os
import queue
import threading
import weakref
from collections import deque
from collections.abc import Iterable, Iterator
from typing import Any, Callable, Protocol

from wds_pad.errors import ConfigError, ReadError

from .options import ReadOptions, ReadStats
from .redact import redact

__all__ = ["BIG_SAMPLE", "LocalReadAhead"]

# Samples at least this large, in local files, are read one payload per pread, without a
# copy out of a range buffer, and parsed ahead by the read-ahead threads.
BIG_SAMPLE = 256 * 1024


class _Reader(Protocol):
    """What a read-ahead needs of its reader: its bounds, its counters, the cached
    descriptors of local shards and the pins that keep them open."""

    options: ReadOptions
    stats: ReadStats
    _busy: dict[int, int]  # descriptor -> reads in flight on read-ahead threads
    _fd_limit: int  # descriptors its cache keeps at most

    def local_fd(self, url: str) -> int | None: ...


class _Job:
    """One local range to parse, run by whoever acquires ``claim`` first: a read-ahead
    thread, or the consumer when it would otherwise wait. ``done`` is released after."""

    __slots__ = ("claim", "done", "parse", "fd", "url", "offset", "length", "arg", "result",
                 "error")

    def __init__(self, parse: Callable[..., Any], fd: int, url: str, offset: int, length: int,
                 arg: Any) -> None:
        self.claim = threading.Lock()
        self.done = threading.Lock()
        self.done.acquire()
        self.parse, self.fd, self.url, self.offset, self.length, self.arg = (
            parse, fd, url, offset, length, arg)
        self.result: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = self.parse(self.fd, self.url, self.offset, self.length, self.arg)
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer with its item
            self.error = exc
        finally:
            self.done.release()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self.done.release()


def _serve(jobs: queue.SimpleQueue[_Job | None], stopped: list[bool]) -> None:
    """A read-ahead thread: runs the jobs it claims, in arrival order, until it takes None.

    It holds only the queue and the flag, never the stream, so a stream dropped without
    being closed is still collected (and its finalizer stops the thread).
    """
    while True:
        job = jobs.get()
        if job is None:
            return
        if job.claim.acquire(False):
            if stopped[0]:
                job.fail(ReadError(f"the read-ahead was closed before byte offset {job.offset} "
                                   f"of {redact(job.url)!r} was read"))
            else:
                job.run()
        job = None  # type: ignore[assignment]  # no finished sample stays alive while idle


def _stop(jobs: queue.SimpleQueue[_Job | None], stopped: list[bool], threads: int) -> None:
    stopped[0] = True  # jobs still queued are skipped, not read
    for _ in range(threads):
        jobs.put(None)


class LocalReadAhead:
    """Large local ranges read (and parsed) ahead of one consumer by a few threads.

    ``os.pread`` releases the GIL, so while the consumer turns item i into a sample, the
    kernel copies the bytes of the next items on another core. When the next item is not
    ready, the consumer runs the first item no thread has started itself instead of
    waiting: ``threads`` threads plus the consumer keep that many cores busy. One object
    per stream, made by :meth:`RangeReader.local_read_ahead`.

    Invariants:
        * :meth:`run` yields one ``(arg, result, error)`` per item, in input order;
          ``error`` is what that item's parse (or opening its shard) raised, and later
          items are still read. An error of the item iterator itself is raised after
          every item before it was yielded.
        * At most ``max_in_flight`` items and ``max(max_bytes_in_flight, largest item)``
          bytes are taken ahead of the consumer (the reader's ``ReadOptions``), as for
          ``read_many``; ``peak_*_in_flight`` in the reader's stats show the peaks.
        * Threads start on first use in the current process and stop on :meth:`close`
          or when this object is garbage collected, without waiting for an item in
          progress; a :meth:`run` abandoned half way drops the items no thread started.
          After ``os.fork`` the child starts its own threads and reads again what the
          parent's had not finished.
        * A descriptor stays open (pinned in the reader's cache) while a thread may read it;
          items of other shards wait while the pinned shards fill the cache's limit.
        * With 0 threads every item is parsed inline, in the consumer.

    Args:
        reader: Opens the shards (in the consumer's thread) and counts stats.
        threads: Read-ahead threads; 0 parses inline.
    """

    def __init__(self, reader: _Reader, threads: int) -> None:
        self.reader = reader
        self.threads = threads
        self._jobs: queue.SimpleQueue[_Job | None] | None = None
        self._pid = -1
        self._stopper: weakref.finalize | None = None
        self._workers: list[threading.Thread] = []

    def __enter__(self) -> LocalReadAhead:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def workers(self) -> list[threading.Thread]:
        """The threads started in this process (none before first use and after close)."""
        return list(self._workers) if self._pid == os.getpid() else []

    def close(self) -> None:
        """Stops the threads (queued items are skipped); the object stays usable."""
        if self._stopper is not None:
            if self._pid == os.getpid():
                self._stopper()
            else:
                self._stopper.detach()  # forked: those threads live in the parent only
        self._jobs, self._stopper, self._workers, self._pid = None, None, [], -1

    def _queue(self) -> queue.SimpleQueue[_Job | None]:
        if self._jobs is None or self._pid != os.getpid():
            self.close()
            jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
            stopped = [False]
            self._workers = [threading.Thread(target=_serve, args=(jobs, stopped), daemon=True,
                                              name=f"wds_pad-local-read-{i}")
                             for i in range(self.threads)]
            for thread in self._workers:
                thread.start()
            self._stopper = weakref.finalize(self, _stop, jobs, stopped, self.threads)
            self._jobs, self._pid = jobs, os.getpid()
        return self._jobs

    def _submit(self, parse: Callable[..., Any], url: str, offset: int, length: int,
                arg: Any) -> _Job:
        reader = self.reader
        try:
            fd = reader.local_fd(url)
            if fd is None:
                raise ConfigError(f"{redact(url)!r} is not a local file; only local ranges "
                                  "are read ahead by threads")
        except Exception as exc:  # noqa: BLE001 - delivered with this item, in order
            job = _Job(parse, -1, url, offset, length, arg)
            job.claim.acquire()
            job.fail(exc)
            return job
        job = _Job(parse, fd, url, offset, length, arg)
        busy = reader._busy  # the descriptor stays open while a thread may read it
        busy[fd] = busy.get(fd, 0) + 1
        self._queue().put(job)
        return job

    def _unpin(self, job: _Job) -> None:
        busy = self.reader._busy
        n = busy.get(job.fd, 0)
        if n > 1:
            busy[job.fd] = n - 1
        elif n:
            del busy[job.fd]

    def run(self, items: Iterable[tuple[str, int, int, Any]],
            parse: Callable[[int, str, int, int, Any], Any],
            ) -> Iterator[tuple[Any, Any, BaseException | None]]:
        """Yields ``(arg, parse(fd, url, offset, length, arg), None)`` per item, in order.

        Args:
            items: ``(url, offset, length, arg)`` of ranges of local files.
            parse: Called on a read-ahead thread (or in the consumer) with the shard's
                cached descriptor; it must not keep the descriptor.

        Yields:
            ``(arg, result, None)``, or ``(arg, None, error)`` for an item whose parse or
            shard failed.
        """
        if self.threads == 0:
            yield from self._inline(items, parse)
            return
        st, opts = self.reader.stats, self.reader.options
        max_n, max_b = opts.max_in_flight, opts.max_bytes_in_flight
        window: deque[_Job] = deque()
        inflight, pid = 0, os.getpid()
        it = iter(items)
        held: tuple[str, int, int, Any] | None = None
        exhausted, failure = False, None
        try:
            while True:
                if os.getpid() != pid:  # forked while suspended: the parent's threads are gone
                    pid = os.getpid()
                    self._resubmit(window)
                while not exhausted:
                    if held is None:
                        try:
                            held = next(it)
                        except StopIteration:
                            exhausted = True
                            break
                        except Exception as exc:  # noqa: BLE001 - raised after the items before it
                            exhausted, failure = True, exc
                            break
                    if window and (len(window) >= max_n or inflight + held[2] > max_b
                                   or len(self.reader._busy) >= self.reader._fd_limit):
                        break
                    window.append(self._submit(parse, *held))
                    inflight += held[2]
                    held = None
                    if inflight > st.peak_bytes_in_flight:
                        st.peak_bytes_in_flight = inflight
                    if len(window) > st.peak_requests_in_flight:
                        st.peak_requests_in_flight = len(window)
                if not window:
                    break
                job = window[0]
                while not job.done.acquire(False):
                    for other in window:  # the first item no thread has started
                        if other.claim.acquire(False):
                            other.run()
                            if other.error is not None and not isinstance(other.error, Exception):
                                raise other.error  # KeyboardInterrupt: at once, not in turn
                            break
                    else:
                        job.done.acquire()
                        break
                window.popleft()
                inflight -= job.length
                self._unpin(job)
                if job.error is None:
                    st.ranges += 1
                    st.requests += 1
                    st.bytes += job.length
                yield job.arg, job.result, job.error
                job = None  # type: ignore[assignment]
            if failure is not None:
                raise failure
        finally:
            for job in window:  # abandoned: claim what no thread started, so none will
                if job.claim.acquire(False):
                    job.fail(ReadError(f"the stream was closed before byte offset {job.offset} "
                                       f"of {redact(job.url)!r} was read"))
                self._unpin(job)

    def _resubmit(self, window: deque[_Job]) -> None:
        """In a forked child: submits again every item the parent had not finished."""
        old = list(window)
        window.clear()
        for job in old:
            if job.done.locked():
                job = self._submit(job.parse, job.url, job.offset, job.length, job.arg)
            else:
                job.fd = -1  # finished; that number may now be one of the child's own
            window.append(job)

    def _inline(self, items: Iterable[tuple[str, int, int, Any]],
                parse: Callable[[int, str, int, int, Any], Any],
                ) -> Iterator[tuple[Any, Any, BaseException | None]]:
        reader, st = self.reader, self.reader.stats
        for url, offset, length, arg in items:
            try:
                fd = reader.local_fd(url)
                if fd is None:
                    raise ConfigError(f"{redact(url)!r} is not a local file")
                result = parse(fd, url, offset, length, arg)
            except Exception as exc:  # noqa: BLE001 - the caller decides, as with threads
                yield arg, None, exc
                continue
            st.ranges += 1
            st.requests += 1
            st.bytes += length
            yield arg, result, None
