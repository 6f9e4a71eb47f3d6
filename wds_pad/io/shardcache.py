"""A plan-aware cache of whole remote shards (``locality="shard"``).

The plan knows which shards a stream reads, in which order, and how many of its ranges
each one serves. :class:`ShardCache` follows that schedule: each planned shard is fetched
whole, in requests of ``ReadOptions.block_bytes``, ahead of its first use (while the
cached and in-flight shard bytes fit ``cache_bytes``; the shard in use is always
fetched), its ranges are sliced from it, and it is dropped right after its last planned
range — the future is known, so eviction is optimal, not LRU. Ranges of shards the
schedule does not list (foreign samples) are none of its business: the reader reads
them with single ranged GETs.

Invariants:
    * a range served from the cache is byte-for-byte the range a ranged GET returns; the
      blocks are fetched by the reader's own retried, timed, stale-checked GET;
    * memory mode (``cache_dir=None``): one stream holds at most ``cache_bytes`` of shards
      plus the one in use; nothing is shared between processes;
    * disk mode (``cache_dir``): a shard is one file ``<owner>-<digest>.shard`` written under an
      exclusive ``flock`` of ``<digest>.lock`` and renamed into place when complete, so
      the DataLoader workers of a rank (every process that plans the same epoch for the
      same DP rank) fetch it once; each user appends its worker id to ``<digest>.done``
      after its last range, and the last of the planned users deletes the files;
    * a schedule is per epoch; the next epoch's is taken when the current one's planned
      ranges are all served, so a resumed stream (whose schedule starts at the restored
      position) fetches no shard it had finished.
"""

from __future__ import annotations

import concurrent.futures
import fcntl
import hashlib
import os
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from .atomic import _alive

__all__ = ["PlannedShard", "ShardCache", "sweep_dead_owners"]


@dataclass(frozen=True)
class PlannedShard:
    """One shard of a stream's schedule for one epoch.

    Attributes:
        url: the shard URL.
        size: its size in bytes (from the index).
        uses: ranges this stream reads from it this epoch.
        users: the DataLoader workers (of this rank) that read from it this epoch.
        key: what names the shared file (the plan fingerprint, epoch and rank).
        skip: ranges of it this stream reads singly before the ``uses`` cached ones (uses
            far before its window's time, so the shard is not held long for them).
        ranges: (start, length) of its cached ranges. From its first read the shard
            counts in the bound as the bytes of these ranges still to be read, each freed
            after its last planned read, so the room goes to the shards fetched next; in
            memory mode it is held as just those bytes (sliced out when its blocks arrive,
            the blocks dropped). Empty: held (and counted) whole until its last range.
        early: how many of the first cached ranges come before the shard's window (the
            plan's windows): when the shard is not fetched yet and fetching it would
            pass the bound, such a range is read singly instead.
    """

    url: str
    size: int
    uses: int
    users: frozenset[int]
    key: str
    skip: int = 0
    ranges: tuple[tuple[int, int], ...] = ()
    early: int = 0


class _Entry:
    __slots__ = ("shard", "blocks", "ready", "left", "path", "started", "skip", "served", "kept", "held",
                 "compacted", "remaining")

    def __init__(self, shard: PlannedShard) -> None:
        self.shard = shard
        self.blocks: list[concurrent.futures.Future[bytes]] = []
        self.ready: concurrent.futures.Future[None] | None = None  # disk mode: the file exists
        self.left = shard.uses
        self.path = ""
        self.started = False
        self.skip = shard.skip
        self.served = 0
        # compacted (memory mode): the late ranges' bytes, once the blocks have arrived
        self.kept: concurrent.futures.Future[dict[tuple[int, int], bytes]] | None = None
        self.held = 0            # the bytes it counts in the bound: its size, then its ranges' still to come
        self.compacted = False
        self.remaining: dict[tuple[int, int], int] = {}  # sliced: planned reads left per range


class ShardCache:
    """Whole shards for one stream of one reader (see the module invariants).

    Args:
        fetch: ``fetch(url, start, length) -> Future[bytes]``: one ranged GET.
        schedule: per epoch, the stream's shards in order of first use.
        block_bytes: size of each GET of a shard.
        cache_bytes: bound on cached plus in-flight shard bytes.
        cache_dir: a local folder shared by the rank's workers, or None (memory).
        owner: disk mode: the pid of the process whose workers share the files (the
            DataLoader's parent; this process without workers). It prefixes their names,
            so files a crashed run left behind are known by their dead owner and removed
            when a cache opens the folder; a resumed run never reuses them.
        worker: this process's DataLoader worker id.
        max_shards: at most this many of the epoch's largest shards' bytes held at once
            (fetched ahead, in use, or compacted), besides the one a read needs; None:
            only ``cache_bytes`` bounds them.
    """

    def __init__(self, fetch: Callable[[str, int, int], concurrent.futures.Future[bytes]],
                 schedule: Iterator[list[PlannedShard]], *, block_bytes: int, cache_bytes: int,
                 cache_dir: str | None = None, worker: int = 0, max_shards: int | None = None,
                 owner: int | None = None) -> None:
        self._get, self._schedule = fetch, schedule
        self.block_bytes, self.cache_bytes = block_bytes, cache_bytes
        self.cache_dir, self.worker, self.max_shards = cache_dir, worker, max_shards
        self._count = 0             # shards started, not yet dropped
        self._order: list[PlannedShard] = []
        self._next = 0              # first shard of _order not yet started
        self._entries: dict[str, _Entry] = {}
        self._left = 0              # planned ranges of the epoch not yet served
        self._held = 0              # bytes of started, not yet dropped shards
        self.peak_bytes = 0
        self.fetched_shards = 0     # shards this process fetched (not found on disk)
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._reads: concurrent.futures.ThreadPoolExecutor | None = None  # one thread: reads in order
        self._lock = threading.Lock()
        self._done = False
        self._limit = cache_bytes   # bytes held at most besides the shard a read needs
        self.compacted = 0          # shards compacted to their late ranges
        self.early_singles = 0      # early ranges read singly (the cache was full)
        self._largest = 0
        self.owner = os.getpid() if owner is None else owner
        self.swept = 0              # files of dead owners removed when the folder was opened
        if cache_dir is not None:
            os.makedirs(cache_dir, exist_ok=True)
            self.swept = sweep_dead_owners(cache_dir)
        self._take_epoch()

    # -- the schedule --------------------------------------------------------------------
    def _take_epoch(self) -> None:
        while not self._done and self._left == 0:
            try:
                order = next(self._schedule)
            except StopIteration:
                self._done = True
                return
            self._order, self._next = [s for s in order if s.uses > 0], 0
            self._entries = {s.url: _Entry(s) for s in self._order}
            self._left = sum(s.uses for s in self._order)
            self._limit = self.cache_bytes
            self._largest = max((s.size for s in self._order), default=0)
            if self.max_shards is not None:
                self._limit = min(self._limit, self.max_shards * self._largest)

    def lists(self, url: str) -> bool:
        """Whether ``url`` is a shard of the current schedule (its ranges are never merged)."""
        return url in self._entries

    def planned(self, url: str) -> bool:
        """Whether the next range of ``url`` comes from the cache (asked once per range)."""
        if self._left == 0:
            self._take_epoch()
        entry = self._entries.get(url)
        if entry is None:
            return False
        if entry.skip > 0:
            entry.skip -= 1
            return False
        if entry.left <= 0:
            return False
        if (not entry.started and entry.served < entry.shard.early
                and self._held + entry.shard.size > self._limit + self._largest):
            # an early range while the cache is full: one ranged GET, not a shard held early
            entry.served += 1
            entry.left -= 1
            self._left -= 1
            self.early_singles += 1
            return False
        return True

    # -- fetching ------------------------------------------------------------------------
    def _start(self, entry: _Entry) -> None:
        size, url = entry.shard.size, entry.shard.url
        entry.started = True
        self._count += 1
        self._held += size
        entry.held = size
        self.peak_bytes = max(self.peak_bytes, self._held)
        if self.cache_dir is None:
            self.fetched_shards += 1
            entry.blocks = [self._get(url, off, min(self.block_bytes, size - off))
                            for off in range(0, size, self.block_bytes)]
            return
        name = hashlib.sha256(f"{entry.shard.key}\0{url}".encode()).hexdigest()[:32]
        entry.path = os.path.join(self.cache_dir, f"{self.owner}-{name}")
        entry.ready = self._threads().submit(self._ensure_file, entry)

    def _threads(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._pool is None:
            # a thread per shard fetched ahead: each mostly waits, on its GETs or on the lock of
            # a shard another worker of the rank is fetching (the workers' orders are alike)
            threads = 2 if self.max_shards is None else max(2, self.max_shards + 1)
            self._pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="wds_pad-shard")
        return self._pool

    def _ensure_file(self, entry: _Entry) -> None:
        data, size = entry.path + ".shard", entry.shard.size
        with open(entry.path + ".lock", "a+b") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                if os.path.exists(data) and os.path.getsize(data) == size:
                    return  # another worker of the rank fetched it
                blocks = [self._get(entry.shard.url, off, min(self.block_bytes, size - off))
                          for off in range(0, size, self.block_bytes)]
                part = f"{data}.{os.getpid()}.part"
                with open(part, "wb") as f:
                    for b in blocks:
                        f.write(b.result())
                os.replace(part, data)
                with self._lock:
                    self.fetched_shards += 1
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _ahead(self, needed: _Entry) -> None:
        """Start ``needed`` (if not yet), then what comes next while it fits."""
        if not needed.started:
            self._start(needed)
        while self._next < len(self._order):
            entry = self._entries[self._order[self._next].url]
            if entry.started or entry.left == 0:
                self._next += 1
                continue
            if self._held + entry.shard.size > self._limit:
                return
            self._start(entry)
            self._next += 1

    # -- reading -------------------------------------------------------------------------
    def read(self, url: str, start: int, length: int, ranges: int = 1) -> concurrent.futures.Future[bytes]:
        """The bytes ``[start, start + length)`` of planned shard ``url``, which serve
        ``ranges`` of its planned ranges; after its last one the shard is dropped."""
        entry = self._entries[url]
        self._ahead(entry)
        if entry.shard.ranges:
            return self._read_ranged(entry, url, start, length, ranges)
        entry.served += ranges
        entry.left -= ranges
        self._left -= ranges
        last = entry.left <= 0
        out: concurrent.futures.Future[bytes] = concurrent.futures.Future()
        if self.cache_dir is None:
            bb = self.block_bytes
            first, end = start // bb, (start + length - 1) // bb if length else start // bb
            blocks = entry.blocks[first:end + 1]
            if last:
                self._drop(entry)

            def done(_: Any) -> None:
                if out.done() or not all(b.done() for b in blocks):
                    return
                try:
                    joined = b"".join(b.result() for b in blocks)
                except BaseException as exc:  # noqa: BLE001 - handed to the reader
                    out.set_exception(exc)
                    return
                lo = start - first * bb
                try:
                    out.set_result(joined[lo:lo + length])
                except concurrent.futures.InvalidStateError:
                    pass
            if not blocks:
                out.set_result(b"")
            for b in blocks:
                b.add_done_callback(done)
            return out
        if last:
            self._drop(entry)
        return self._from_disk(entry, start, length, last)

    def _from_disk(self, entry: _Entry, start: int, length: int, last: bool) -> concurrent.futures.Future[bytes]:
        """A range read from the shard's file once it is complete (``last``: this
        worker's last read of it, after which it says so for the shared deletion)."""
        ready: concurrent.futures.Future[None] = entry.ready  # type: ignore[assignment]

        def from_disk() -> bytes:
            ready.result()
            with open(entry.path + ".shard", "rb") as f:
                data = os.pread(f.fileno(), length, start)
            if last:
                self._finish_on_disk(entry)
            return data
        if self._reads is None:
            self._reads = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="wds_pad-shard-read")
        return self._reads.submit(from_disk)

    def _read_ranged(self, entry: _Entry, url: str, start: int, length: int,
                     ranges: int) -> concurrent.futures.Future[bytes]:
        """A shard with planned ranges: from its first read it counts in the bound as the
        bytes of its ranges still to be read, each freed after its last planned read. In
        memory it is held as just those bytes; on disk the file stays until its last range
        (disk, not memory, so the bound counts what this worker still reads of it)."""
        if not entry.compacted:  # its first read: from now on it counts as its ranges' bytes
            entry.compacted = True
            for r in entry.shard.ranges:
                entry.remaining[r] = entry.remaining.get(r, 0) + 1
            kept_bytes = sum(n for _, n in entry.remaining)
            self._held += kept_bytes - entry.held
            entry.held = kept_bytes
            if self.cache_dir is None:
                self._compact(entry, list(entry.remaining))
            self.compacted += 1
        entry.served += ranges
        entry.left -= ranges
        self._left -= ranges
        key = (start, length)
        count = entry.remaining.get(key, 0)
        freed = count == 1
        if freed:
            del entry.remaining[key]
            entry.held -= length
            self._held -= length
        elif count:
            entry.remaining[key] = count - 1
        last = entry.left <= 0
        if last:
            self._drop(entry)
        if self.cache_dir is None:
            out = self._from_kept(url, entry.kept, start, length, pop=freed)  # type: ignore[arg-type]
        else:
            out = self._from_disk(entry, start, length, last)
        self._ahead(entry)  # the room it freed goes to the next shards now
        return out

    def _compact(self, entry: _Entry, ranges: list[tuple[int, int]]) -> None:
        """Keeps only the bytes of ``ranges`` of the shard, and drops its blocks (once
        they have arrived)."""
        blocks, bb = entry.blocks, self.block_bytes
        kept: concurrent.futures.Future[dict[tuple[int, int], bytes]] = concurrent.futures.Future()
        entry.kept, entry.blocks = kept, []

        def done(_: Any) -> None:
            if kept.done() or not all(b.done() for b in blocks):
                return
            try:
                data = [b.result() for b in blocks]
                table = {(st, n): _slice(data, bb, st, n) for st, n in ranges}
            except BaseException as exc:  # noqa: BLE001 - handed to the reads
                _settle(kept, exc=exc)
                return
            _settle(kept, table)
        if not blocks:
            kept.set_result({})
        for b in blocks:
            b.add_done_callback(done)

    def _from_kept(self, url: str, kept: concurrent.futures.Future[dict[tuple[int, int], bytes]],
                   start: int, length: int, pop: bool) -> concurrent.futures.Future[bytes]:
        """A range of a sliced shard (``pop``: its last read; a range it does not keep:
        one ranged GET)."""
        out: concurrent.futures.Future[bytes] = concurrent.futures.Future()

        def done(_: Any) -> None:
            try:
                table = kept.result()
            except BaseException as exc:  # noqa: BLE001 - handed to the reader
                _settle(out, exc=exc)
                return
            data = table.pop((start, length), None) if pop else table.get((start, length))
            if data is None:
                self._get(url, start, length).add_done_callback(lambda f: _chain_into(f, out))
                return
            _settle(out, data)
        kept.add_done_callback(done)
        return out

    def _drop(self, entry: _Entry) -> None:
        self._held -= entry.held
        entry.held = 0
        self._count -= 1
        if self.cache_dir is None:
            entry.blocks = []

    def _finish_on_disk(self, entry: _Entry) -> None:
        """This worker is done with the shard; the last planned user deletes it."""
        with open(entry.path + ".lock", "a+b") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                with open(entry.path + ".done", "a") as f:
                    f.write(f"{self.worker}\n")
                with open(entry.path + ".done") as f:
                    done = {int(x) for x in f.read().split()}
                if entry.shard.users <= done:
                    for suffix in (".shard", ".done", ".lock"):
                        try:
                            os.unlink(entry.path + suffix)
                        except FileNotFoundError:
                            pass
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def close(self) -> None:
        """Stops the helper threads (cached blocks are dropped with the cache)."""
        for pool in (self._pool, self._reads):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)
        self._pool = self._reads = None



def _slice(blocks: list[bytes], bb: int, start: int, length: int) -> bytes:
    """Bytes ``[start, start + length)`` of a shard held as blocks of ``bb`` bytes."""
    first, end = start // bb, (start + length - 1) // bb if length else start // bb
    lo = start - first * bb
    if first == end:
        return blocks[first][lo:lo + length]
    return b"".join(blocks[first:end + 1])[lo:lo + length]


def _settle(fut: concurrent.futures.Future[Any], result: Any = None, exc: BaseException | None = None) -> None:
    """Sets a future's outcome unless it is already set (cancelled by the reader)."""
    try:
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(result)
    except concurrent.futures.InvalidStateError:
        pass


def _chain_into(src: concurrent.futures.Future[bytes], dst: concurrent.futures.Future[bytes]) -> None:
    try:
        _settle(dst, src.result())
    except BaseException as exc:  # noqa: BLE001 - handed to the reader
        _settle(dst, exc=exc)


def sweep_dead_owners(folder: str) -> int:
    """Removes the shard files in ``folder`` whose owner process is gone (a run that crashed
    or was killed before its last planned reads deleted them), and partial downloads
    (``.<pid>.part``) of dead writers; the number of files removed. Files of live owners,
    and anything not named by this cache, are left alone."""
    removed = 0
    try:
        names = os.listdir(folder)
    except OSError:
        return 0
    for name in names:
        stem, _, suffix = name.rpartition(".")
        if suffix == "part":
            pid = stem.rpartition(".")[2]
        elif suffix in ("shard", "lock", "done"):
            pid = stem.partition("-")[0]
        else:
            continue
        if not pid.isdigit() or _alive(int(pid)):
            continue
        try:
            os.unlink(os.path.join(folder, name))
            removed += 1
        except OSError:
            pass
    return removed
