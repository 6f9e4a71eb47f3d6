"""The node cache: one copy of each shard for every process of a node that names the same folder.

Every process of a job on one machine (each local rank, its DataLoader workers, its
context- and tensor-parallel peers) follows its own reads through a :class:`NodeCache`
over one folder (:mod:`wds_pad.io.nodefolder`). The plans of the node's ranks, which are
pure, say which shards the node reads in each epoch, which of them some rank reads whole,
and when each one is read (``NodeEpoch``, :mod:`wds_pad.io.shardplan`). A shard the node
holds is fetched whole once, by whichever process needs it first, and every read of it by
any process of the node, whole-shard reads and single ones alike (foreign samples, early,
late, padded copies), comes from that copy, read while it arrives. The files and their
locks are :mod:`wds_pad.io.nodefiles`', the room in the folder :mod:`wds_pad.io.noderoom`'s.

Invariants:
    * A range read from the node's copy is byte for byte what a ranged GET returns: the
      copy is written in order from the reader's own retried, timed, stale-checked GETs of
      ``block_bytes``, and a range is read only once the file holds its end.
    * GETs follow the planned reads, not timing: a shard the node holds in an epoch is
      fetched once per node while the folder keeps it; a shard it does not hold is read
      from a complete copy already in the folder, else by single ranged GETs.
    * Bytes in the folder (complete shards, plus the full size of every ``.part``) stay
      within ``cache_bytes`` before each fetch: the shards whose next planned use (by any
      process of the node, this epoch or the next) is furthest are removed first, and a
      shard is never removed for one needed later than itself, nor while a process reads
      it: from a read of it to the next, within a window's steps of each other, the
      process holds the file's shared lock. A shard fetched ahead is fetched only within the bound; one a
      read needs is fetched in any case, and once this process is done with a shard the
      files past the bound that nobody reads go: the folder holds ``cache_bytes`` plus the
      shards in flight, copies of shards indexed again included (:mod:`wds_pad.io.noderoom`).
    * A shard the node does not read in the next epoch is removed by the last of its
      users, after their last planned read of it; one it reads again stays, within
      ``cache_bytes``, for the next epoch and for a restart on the same folder.
    * A read waits only for a live writer making progress: a ``.part`` whose writer died
      is taken over at once; no progress for ``guard`` seconds raises a ``ReadError``.
    * A copy is served only as the bytes the index describes, checked once per job on the
      node (:mod:`wds_pad.io.nodecheck`); the folder's faults: :mod:`wds_pad.io.nodeproblems`.
    * Reads keep their order: one read thread serves a read whose bytes are not all in the
      file yet, and every read after it; a read whose bytes are there while that thread is
      idle is read at once. A schedule is per epoch; the next one is taken when this
      process's planned reads of the current one are all served.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import os
import threading
import time
from typing import Callable, Iterator

from wds_pad.errors import ReadError

from . import nodecheck, nodefiles, noderoom
from .nodeproblems import disk_full
from .redact import redact
from .shardplan import NodeEntry, NodeEpoch, NodeShard

__all__ = ["NodeCache"]

class NodeCache:
    """One process's reads through the node's copies (see the module invariants).

    Args:
        fetch: ``fetch(url, start, length) -> Future[bytes]``: one ranged GET.
        schedule: per epoch, what the node's plans say of it (``NodeEpoch``).
        folder: the folder the node's processes share.
        block_bytes: size of each GET of a shard.
        cache_bytes: bound on the folder's shard bytes.
        ahead: how far this process fetches ahead, in shards of its order past the first
            one it has not finished reading; None: all of them (within ``cache_bytes``).
        guard: seconds a read waits for a writer that makes no progress.
        depth: shards fetched ahead at once, and GETs in flight per shard fetched.
        check: ``check(url)`` asks the store whether the shard is the indexed one (one
            HEAD), raising :class:`StaleShardError` if not; None: no such check.
        session: this job on this node (``wds_pad.io.nodefolder.job_session``): the
            processes of one session take each other's word on a copy's check.
        kept: copies outlive the job (a ``cache_dir``): each checksummed (:func:`nodefiles.complete`).
    """

    def __init__(self, fetch: Callable[[str, int, int], concurrent.futures.Future[bytes]],
                 schedule: Iterator[NodeEpoch], *, folder: str, block_bytes: int, cache_bytes: int,
                 ahead: int | None = None, guard: float = 600.0, depth: int = 2,
                 check: Callable[[str], None] | None = None, session: str = "", kept: bool = True) -> None:
        self._get, self._schedule, self.folder = fetch, schedule, folder
        self.block_bytes, self.cache_bytes, self.ahead = block_bytes, cache_bytes, 1 << 62 if ahead is None else max(0, ahead)
        self.guard, self.depth, self.kept = guard, max(1, depth), kept
        self.checks = nodecheck.Checks(folder, check, session)  # of the copies this process serves
        self._lock = threading.Lock()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._reads: concurrent.futures.ThreadPoolExecutor | None = None  # one thread: its descriptors
        self._epoch: NodeEpoch | None = None
        self._entries: dict[str, NodeEntry] = {}
        self._by_name: dict[str, NodeShard] = {}
        self._left = 0        # this process's planned reads of the epoch not yet counted
        self._now = 0         # the step of its latest planned read
        self._cur = 0         # its order's first shard it has not finished reading
        self._next = 0        # its order's first shard not yet looked at for fetching ahead
        self._running: set[concurrent.futures.Future[str]] = set()  # fetches ahead
        self._pending: tuple[NodeEntry, bool, bool] | None = None  # planned() -> read()
        self._queued: concurrent.futures.Future[bytes] | None = None  # the last read handed to the read thread
        self._done = self._closed = False
        self.peak_bytes = 0       # most bytes seen in the folder when a fetch made room
        self.fetched_shards = 0   # shards this process fetched (or finished) whole
        self.evicted = 0          # shards it removed to make room
        self.finished = 0         # shards it removed after the node's last planned read
        self._take_epoch()
        self.reclaimed = noderoom.reclaim(folder, set(self._by_name))  # partial copies of them stay

    # -- the schedule --------------------------------------------------------------------
    def _take_epoch(self) -> None:
        while not self._done and self._left <= 0:
            try:
                ep = next(self._schedule)
            except StopIteration:
                self._done = True
                return
            with self._lock:
                done = list(self._entries.values())
                self._epoch = ep
                self._entries = {url: NodeEntry(s, ep) for url, s in ep.shards.items()}
                self._by_name = {s.name: s for s in ep.shards.values()}
                self._left = sum(int(s.mine.size) for s in ep.shards.values())
                self._now = self._cur = self._next = 0
            if self._reads is not None:  # after the epoch's reads still queued, its descriptors go
                self._queued = self._reads.submit(lambda: [self._close(e) for e in done])  # type: ignore[func-returns-value]
            self._prefetch()

    def lists(self, url: str) -> bool:
        """Whether ``url`` is read by the node this epoch (its ranges are never merged)."""
        return url in self._entries

    def planned(self, url: str) -> bool:
        """Whether the next range of ``url`` comes from the node's copy (asked once per range)."""
        if self._left <= 0:
            self._take_epoch()
        entry = self._entries.get(url)
        if entry is None:
            self._pending = None
            return False
        mine = entry.shard.mine
        if mine.size:
            self._now = max(self._now, int(mine[min(entry.seen, mine.size - 1)]))
        entry.seen += 1
        self._left -= 1
        last = entry.seen == mine.size
        if last:
            entry.finished = True
        # a read long before this process's next one of the shard: it lets the file go meanwhile
        pause = not last and mine.size > entry.seen and int(mine[entry.seen]) - self._now > self._epoch.span  # type: ignore[union-attr]
        if entry.shard.held:
            use = True
        else:
            if entry.present is None:
                entry.present = nodefiles.present(self.folder, entry.shard.name)
            use = entry.present
        self._pending = (entry, last, pause) if use else None
        return use

    # -- reading -------------------------------------------------------------------------
    def read(self, url: str, start: int, length: int, ranges: int = 1) -> concurrent.futures.Future[bytes]:
        """The bytes ``[start, start + length)`` of shard ``url``, from the node's copy."""
        pending, self._pending = self._pending, None
        entry, last, pause = (pending if pending is not None and pending[0].shard.url == url
                              else (self._entries[url], False, False))
        if last:
            self._prefetch()
        queued = self._queued
        if queued is None or queued.done():  # the read thread is idle: bytes already here are read now
            try:
                fd = self._open(entry)
            except Exception as exc:  # noqa: BLE001 - the copy's check failed: this read fails, in order
                failed: concurrent.futures.Future[bytes] = concurrent.futures.Future()
                failed.set_exception(exc)
                return failed
            if fd is not None and os.fstat(fd).st_size >= min(start + length, entry.shard.size):
                out: concurrent.futures.Future[bytes] = concurrent.futures.Future()
                out.set_result(os.pread(fd, length, start))
                self._after(entry, last, pause)
                return out
        if self._reads is None:
            self._reads = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="wds_pad-node-read")
        self._queued = self._reads.submit(self._read, entry, start, length, last, pause)
        return self._queued

    def _read(self, entry: NodeEntry, start: int, length: int, last: bool, pause: bool) -> bytes:
        data = self._wait_read(entry, start, length)
        self._after(entry, last, pause)
        return data

    def _after(self, entry: NodeEntry, last: bool, pause: bool) -> None:
        if last:
            self._done_with(entry)
        elif pause:
            self._close(entry)  # its shared lock goes: evictable until this process reads it again

    def _wait_read(self, entry: NodeEntry, start: int, length: int) -> bytes:
        end = min(start + length, entry.shard.size)
        seen, since, delay = -1, time.monotonic(), 0.0005
        while True:
            if self._closed:
                raise concurrent.futures.CancelledError()
            fd = self._open(entry)
            if fd is not None:
                have = os.fstat(fd).st_size
                if have >= end:
                    data = os.pread(fd, length, start)
                    if not entry.complete and have == entry.shard.size and nodefiles.writer_gone(fd):
                        self._close(entry)  # renamed complete: the next read opens it as such
                    return data
                if have != seen:
                    seen, since = have, time.monotonic()
                if not entry.complete and nodefiles.writer_gone(fd):
                    if os.fstat(fd).st_size >= end:  # finished meanwhile
                        continue
                    self._close(entry)  # its writer died or gave up: this process takes it over
                    self._fetch(entry, urgent=True)
            else:
                self._fetch(entry, urgent=True)
            fetch = entry.fetch
            if fetch is not None and fetch.done() and fetch.exception() is not None:
                raise fetch.exception()  # type: ignore[misc]
            if time.monotonic() - since > self.guard:
                raise ReadError(
                    f"waited {self.guard:.0f} s for bytes {start}..{start + length} of {redact(entry.shard.url)!r} "
                    f"from the node's copy in {self.folder!r}, and its writer (another process, alive: it holds "
                    "the lock) made no progress; check that process, or raise ReadOptions.timeout")
            time.sleep(delay)
            delay = min(2 * delay, 0.01)

    def _open(self, entry: NodeEntry) -> int | None:
        if entry.fd is None:
            got = nodefiles.open_copy(self.folder, entry.shard.name)
            if got is not None:
                fd, complete = got
                try:
                    if complete and not self.checks.ok(entry.shard.url, entry.shard.name, entry.shard.size, fd):
                        os.close(fd)  # damaged, removed: fetched again
                        return None
                except BaseException:
                    os.close(fd)
                    raise
                entry.fd, entry.complete = got
                if entry.complete:
                    nodefiles.in_use(entry.fd)  # not evicted while this process reads it
        return entry.fd

    def _check_present(self, shard: NodeShard) -> bool:
        """Checks ahead of its reads a complete copy found in the folder; False if it was
        damaged (removed) or is gone."""
        got = nodefiles.open_copy(self.folder, shard.name)
        if got is None:
            return False
        try:
            return got[1] and self.checks.ok(shard.url, shard.name, shard.size, got[0])
        finally:
            os.close(got[0])

    def _close(self, entry: NodeEntry) -> None:
        if entry.fd is not None:
            os.close(entry.fd)
            entry.fd = None

    def _done_with(self, entry: NodeEntry) -> None:
        """This process's last planned read of the shard in the epoch: its descriptor goes, a
        shard the node does not read next epoch goes with its last user, else the folder is trimmed."""
        self._close(entry)
        if entry.fetch is not None and entry.fetch.running():  # this process publishes it: then it counts as done
            concurrent.futures.wait([entry.fetch])
        ep = entry.epoch
        if entry.shard.name not in ep.later and noderoom.finish(
                self.folder, entry.shard.name, ep.epoch, ep.me, entry.shard.users):
            with self._lock:
                self.finished += 1
        else:  # past the bound while it was read: what nobody reads now goes (old copies first)
            self.evicted += noderoom.trim(self.folder, self.cache_bytes, self._rank)

    # -- fetching ------------------------------------------------------------------------
    def _threads(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._pool is None:  # fetches ahead (at most depth at once) plus the ones reads wait for
            self._pool = concurrent.futures.ThreadPoolExecutor(self.depth + 2, thread_name_prefix="wds_pad-node-fetch")
        return self._pool

    def _fetch(self, entry: NodeEntry, urgent: bool) -> concurrent.futures.Future[str] | None:
        with self._lock:
            if entry.fetch is not None and not entry.fetch.done():
                return None
            if entry.fetch is not None and entry.fetch.exception() is not None:
                return None  # failed: the read raises its error
            entry.fetch = self._threads().submit(self._fetch_file, entry, urgent)
            return entry.fetch

    def _prefetch(self) -> None:
        """Fetches ahead, in this process's order (of first use), the shards up to ``ahead``
        past the first one it has not finished reading, ``depth`` at a time: the link goes
        to the shards needed first, and the rest wait in line (a shard another process is
        fetching counts as fetched)."""
        with self._lock:
            ep = self._epoch
            if ep is None:
                return
            self._running = {f for f in self._running if not f.done()}
            while self._cur < len(ep.order) and self._entries[ep.order[self._cur]].finished:
                self._cur += 1
            starts = []
            while (self._next < len(ep.order) and self._next <= self._cur + self.ahead
                   and len(self._running) + len(starts) < self.depth):
                entry = self._entries.get(ep.order[self._next])
                self._next += 1
                if entry is not None and entry.fetch is None:
                    starts.append(entry)
        for entry in starts:
            fut = self._fetch(entry, urgent=False)
            if fut is not None:
                with self._lock:
                    self._running.add(fut)
                fut.add_done_callback(self._after_fetch)

    def _after_fetch(self, _: concurrent.futures.Future[str]) -> None:
        """A fetch ahead ended: the next one starts (none once closed, or at exit)."""
        with contextlib.suppress(RuntimeError):  # "cannot schedule new futures after ... shutdown"
            if not self._closed:
                self._prefetch()

    def _fetch_file(self, entry: NodeEntry, urgent: bool) -> str:
        """Makes the shard's copy complete, unless another process is at it: "done" (fetched
        here), "present", "busy" (another writer), "skipped" (fetched ahead: no room)."""
        shard = entry.shard
        if entry.finished and not urgent:
            return "skipped"  # read meanwhile: a copy now is no longer needed here
        if nodefiles.present(self.folder, shard.name) and self._check_present(shard):
            return "present"  # no lock taken: a folder this process cannot write serves what it holds
        for _ in range(3):  # a copy found damaged is fetched again
            status, fd = self._claim(shard, urgent)
            if fd is not None or status != "present" or self._check_present(shard):
                break
        if fd is None:
            return status
        try:
            return self._write(shard, fd)
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
        if self._evict_unneeded(shard):  # the disk is full: what no plan reads again goes, then once more
            status, fd = self._claim(shard, urgent=True)
            if fd is None:
                return status
            try:
                return self._write(shard, fd)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
        held = sum(b for _, _, b in noderoom.scan(self.folder))
        raise disk_full(self.folder, shard.url, shard.size, held, self.cache_bytes)

    def _evict_unneeded(self, shard: NodeShard) -> int:
        """Removes the shards no plan of the node reads again (nor being read); how many."""
        removed = noderoom.drop_unneeded(self.folder, shard.name, self._rank)
        self.evicted += removed
        return removed

    def _write(self, shard: NodeShard, fd: int) -> str:
        """Completes, checks and publishes the locked ``.part`` open as ``fd``."""
        if nodefiles.complete(self.folder, shard.name, fd, shard.url, shard.content, self._get,
                              self.block_bytes, self.depth, self.checks.session, self.kept):
            with self._lock:
                self.fetched_shards += 1
        self.checks.fetched(shard.name)
        return "done"

    def _claim(self, shard: NodeShard, urgent: bool) -> tuple[str, int | None]:
        """Becomes the shard's writer within ``cache_bytes`` (:func:`noderoom.claim_within`):
        never removing a shard used before ``shard``, nor, for a read that needs it now, one
        used before this process's latest step. (status, locked ``.part``) as
        :func:`nodefiles.claim`, or ("skipped", None)."""
        now = self._now
        bar = now if urgent else self._rank(shard.name)
        got = noderoom.claim_within(self.folder, shard.name, self.cache_bytes, self._rank, bar, urgent)
        self.evicted += got.evicted
        if got.status != "skipped":
            self.peak_bytes = max(self.peak_bytes, got.used)
        return got.status, got.fd

    def _rank(self, stem: str) -> int:
        """The step of the node's next planned read of ``stem`` after this process's latest."""
        return noderoom.next_use(self._epoch, self._by_name, stem, self._now)

    def close(self) -> None:
        """Stops the helper threads; the read thread closes its descriptors (the copies stay)."""
        self._closed = True
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        if self._reads is not None:  # reads still queued return at once, then the descriptors go
            entries = list(self._entries.values())
            self._reads.submit(lambda: [self._close(e) for e in entries])
            self._reads.shutdown(wait=False)
        else:
            for entry in self._entries.values():
                self._close(entry)
        self._pool = self._reads = None
