"""Remote (or mixed) ranges in flight: merged, bounded, retried, handed out in order.

The remote half of :class:`~wds_pad.io.ranges.RangeReader` (a mixin it inherits):
``read_many`` continues here from the first range the local fast path
(:mod:`wds_pad.io.localfiles`) cannot read inline.

Invariants:
    * One ``bytes`` per input range, in input order, each exactly ``length`` long; a
      shorter answer raises :class:`StaleShardError`, a longer one (a server ignoring
      the Range header), for a sample or for a block of a whole shard, a
      :class:`ReadError` that says what works instead; it is never sliced.
    * At most ``max_in_flight`` requests are outstanding (fewer where a share of the
      descriptor limit is smaller: each may hold a connection), and the bytes requested but not
      yet handed out never exceed ``max(max_bytes_in_flight, largest single range)``.
    * Consecutive ranges of one URL within ``merge_gap`` are fetched as one request of at
      most ``min(max_merged_bytes, max_bytes_in_flight)`` bytes and sliced; ranges of a
      shard the :class:`~wds_pad.io.shardcache.ShardCache` lists are never merged, and
      those it plans are served from it.
    * Requests run as coroutines on fsspec's IO loop: async filesystems (s3fs, HTTP)
      natively, sync ones through a thread pool. Every attempt has a timeout; transient
      failures are retried with exponential backoff whose jitter derives from (url,
      offset, attempt), never the clock (:mod:`wds_pad.io.remote`); permanent ones fail
      at once. A failed attempt is judged as every store fault is (:mod:`wds_pad.io.faults`).
    * A failed range (or a closed iterator) cancels every request in flight; an error a
      cancelled one still ends in is retrieved, so asyncio prints nothing: the caller
      sees one error. A request hung past every retry's time raises a :class:`ReadError`.
    * Retries are logged at INFO on the ``wds_pad.io.ranges`` logger, redacted.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import threading
import time
from collections import deque
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import fsspec.asyn

from wds_pad.errors import ReadError, WdsPadError

from .faults import attempt_error, cause_text, error_chain, retries_exhausted
from .localfiles import check_range
from .options import ReadOptions, ReadStats
from .redact import redact
from .remote import backoff_delay, Target, watched_future
from .stale import short_read, ShardCheck

if TYPE_CHECKING:
    from .shardcache import ShardCache

# the reader's logger, under the name of the module users know it by
logger = logging.getLogger("wds_pad.io.ranges")


class _Request:
    """One fetch serving one or more consecutive input ranges of one URL."""

    __slots__ = ("url", "target", "start", "end", "parts", "future", "data", "cached")

    def __init__(self, url: str, target: Target, offset: int, length: int) -> None:
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


class InFlight:
    """The read-ahead loop of remote ranges (see the module invariants).

    Mixed into :class:`~wds_pad.io.ranges.RangeReader`, which owns the state below.
    """

    options: ReadOptions
    stats: ReadStats
    _stats_lock: threading.Lock
    _check: ShardCheck
    _pool: concurrent.futures.ThreadPoolExecutor | None
    _cache: ShardCache | None
    _fd_limit: int  # a share of the descriptor limit (wds_pad.io.descriptors.fd_budget)

    if TYPE_CHECKING:
        def _target(self, url: str) -> Target: ...

        def _pread(self, url: str, offset: int, length: int) -> bytes: ...

    def _pool_for_sync(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                self.options.max_in_flight, thread_name_prefix="wds_pad-read")
        return self._pool

    def _get_block(self, url: str, start: int, length: int) -> concurrent.futures.Future[bytes]:
        """One ranged GET of a shard's block (retried, timed, stale-checked like any)."""
        target = self._target(url)
        with self._stats_lock:
            self.stats.requests += 1
            self.stats.bytes += length
            self.stats.shard_blocks += 1
        pool = None if target.is_async else self._pool_for_sync()
        loop = target.loop or fsspec.asyn.get_loop()
        return asyncio.run_coroutine_threadsafe(self._fetch(target, pool, url, start, length, 1, block=True), loop)

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

    async def _fetch(self, target: Target, pool: concurrent.futures.Executor | None,
                     url: str, start: int, length: int, nparts: int, block: bool = False) -> bytes:
        opts, attempt = self.options, 0
        watched_future(asyncio.current_task())  # cancelled by a consumer gone, it may still fail
        what = f"{length} bytes at byte offset {start} of {redact(url)!r}" + (
            f" (one request for {nparts} merged ranges)" if nparts > 1 else "")
        while True:
            attempt += 1
            with self._stats_lock:  # on the IO loop's thread: one GET per attempt
                self.stats.gets += 1
            try:
                if pool is None:
                    call = self._check.get(target, url, start, start + length)
                else:
                    call = asyncio.get_running_loop().run_in_executor(pool, functools.partial(
                        target.fs.cat_file, target.path, start=start, end=start + length))
                data = await asyncio.wait_for(watched_future(call), opts.timeout)
            except WdsPadError:
                raise
            except Exception as exc:  # noqa: BLE001 - judged below, raised as ours
                failure: BaseException = exc
            else:
                if len(data) > length:  # never sliced: the bytes might not be the ones asked for
                    raise self._ignored_range(url, start, length, len(data), block)
                with self._stats_lock:
                    self.stats.get_bytes += len(data)
                return data  # type: ignore[no-any-return]
            # Raised outside the except clause so no __context__ holds an unredacted text.
            error = self._judge(failure, what, attempt, url)
            if error is not None:
                raise error from error_chain(failure)
            delay = backoff_delay(opts, url, start, attempt)
            logger.info("retrying %s in %.2f s after %s", what, delay,
                        cause_text(failure, opts.timeout))
            await asyncio.sleep(delay)

    def _ignored_range(self, url: str, start: int, length: int, got: int, block: bool) -> ReadError:
        """The error for an answer longer than the range asked for: the server ignored the
        Range header. It says what works for this read: a server that honours Range, or
        whole shards in one GET each (``locality="shard"``, a shard within one block)."""
        said = (f"{redact(url)!r} returned {got} bytes for a range of {length} at byte offset {start}: "
                "the server ignored the Range header (as python -m http.server does)")
        server = "a server that honours Range (nginx, Apache, caddy, an S3-compatible store)"
        if block:
            want = self._check.expected.get(url) if self._check.expected is not None else None
            size = want[0] if want is not None and want[0] >= 0 else got
            return ReadError(f"{said}; with locality='shard' a shard is read in one GET without Range when it "
                             f"fits in one block: raise ReadOptions(block_bytes=...) to the largest shard's size "
                             f"(this one has {size} bytes, a block {self.options.block_bytes}), or serve the "
                             f"shards from {server}")
        if self._cache is not None:
            return ReadError(f"{said}; this sample is read alone (a foreign sample of locality='shard', or one "
                             f"read before its shard arrived), which needs {server}")
        return ReadError(f"{said}; a single sample is read with Range: serve the shards from {server}, or stream "
                         "with locality='shard', which reads each shard whole in one GET without Range (when it "
                         "fits in ReadOptions.block_bytes) and reads alone only the few samples that `wds-pad plan "
                         "--summary --locality shard` counts as single reads (foreign ones, mostly), which still "
                         "need Range")

    def _judge(self, exc: BaseException, what: str, attempt: int, url: str = "",
               ) -> Exception | None:
        """Returns the error to raise for a failed attempt, or None to retry it."""
        opts = self.options
        error = attempt_error(exc, what, url, opts.timeout)
        if error is not None:
            return error
        with self._stats_lock:
            self.stats.timeouts += isinstance(exc, TimeoutError)
            if attempt <= opts.retries:
                self.stats.retries += 1
                return None
        return retries_exhausted(exc, what, attempt, url, opts.timeout, opts.retries)

    def _read_general(self, it: Iterator[Any], nxt: tuple[str, int, int] | None,
                      ) -> Iterator[bytes]:
        """Read-ahead loop for remote (or mixed) streams; see the module invariants."""
        opts, st, cache = self.options, self.stats, self._cache
        cap = min(opts.max_merged_bytes, opts.max_bytes_in_flight)
        # each request may hold a connection (a descriptor): within the limit's share
        gap, max_n, max_b = opts.merge_gap, min(opts.max_in_flight, self._fd_limit), opts.max_bytes_in_flight
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
                            nxt = check_range(next(it))
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
                    if head.cached and head.future.done():
                        st.cache_hits += 1
                    began = time.perf_counter_ns()  # per request: the wait on the store or the cache
                    try:
                        data = head.future.result(timeout=guard)
                    except concurrent.futures.TimeoutError:
                        raise ReadError(f"reading byte offset {head.start} of "
                                        f"{redact(head.url)!r} hung past {guard:.0f} s; the IO "
                                        "loop is blocked") from None
                    waited = time.perf_counter_ns() - began
                    if head.cached:
                        st.cache_wait_ns += waited
                    else:
                        st.get_wait_ns += waited
                    st.wait_ns_by_url[head.url] = st.wait_ns_by_url.get(head.url, 0) + waited
                    st.waited_urls.add(head.url)
                size = head.end - head.start
                if len(data) < size:  # longer: refused by _fetch (the server ignored Range)
                    for off, ln in head.parts:
                        if off + ln - head.start > len(data):
                            raise short_read(head.url, off, ln,
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
