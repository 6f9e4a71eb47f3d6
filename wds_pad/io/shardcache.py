"""A plan-aware cache of whole remote shards in one process's memory (``locality="shard"``).

The plan knows which shards a stream reads, in which order, and how many of its ranges
each one serves. :class:`ShardCache` follows that schedule: each planned shard is fetched
whole, in requests of ``ReadOptions.block_bytes``, ahead of its first use (while the
cached and in-flight shard bytes fit ``cache_bytes``; the shard in use is always
fetched), its ranges are sliced from it, and it is dropped right after its last planned
range — the future is known, so eviction is optimal, not LRU. Ranges of shards the
schedule does not list (foreign samples) are none of its business: the reader reads
them with single ranged GETs.

This is the cache of a single process without a ``cache_dir``. Processes that share a
node (local ranks, DataLoader workers, context-parallel peers) share one copy of each
shard on disk instead: :mod:`wds_pad.io.nodecache`. This module holds the schedule and
the bound; the records are in :mod:`wds_pad.io.shardplan`, the blocks in
:mod:`wds_pad.io.shardmemory`.

Invariants:
    * a range served from the cache is byte-for-byte the range a ranged GET returns; the
      blocks are fetched by the reader's own retried, timed, stale-checked GET;
    * one stream holds at most ``cache_bytes`` of shards plus the one in use; nothing is
      shared between processes;
    * a schedule is per epoch; the next epoch's is taken when the current one's planned
      ranges are all served, so a resumed stream (whose schedule starts at the restored
      position) fetches no shard it had finished.
"""

from __future__ import annotations

import concurrent.futures
from typing import Callable, Iterator

from .shardmemory import compact, from_kept, read_blocks
from .shardplan import PlannedShard, ShardEntry

__all__ = ["PlannedShard", "ShardCache"]


class ShardCache:
    """Whole shards for one stream of one reader (see the module invariants).

    Args:
        fetch: ``fetch(url, start, length) -> Future[bytes]``: one ranged GET.
        schedule: per epoch, the stream's shards in order of first use.
        block_bytes: size of each GET of a shard.
        cache_bytes: bound on cached plus in-flight shard bytes.
        max_shards: at most this many of the epoch's largest shards' bytes held at once
            (fetched ahead, in use, or compacted), besides the one a read needs; None:
            only ``cache_bytes`` bounds them.
    """

    def __init__(self, fetch: Callable[[str, int, int], concurrent.futures.Future[bytes]],
                 schedule: Iterator[list[PlannedShard]], *, block_bytes: int, cache_bytes: int,
                 max_shards: int | None = None) -> None:
        self._get, self._schedule = fetch, schedule
        self.block_bytes, self.cache_bytes = block_bytes, cache_bytes
        self.max_shards = max_shards
        self._count = 0             # shards started, not yet dropped
        self._order: list[PlannedShard] = []
        self._next = 0              # first shard of _order not yet started
        self._entries: dict[str, ShardEntry] = {}
        self._left = 0              # planned ranges of the epoch not yet served
        self._held = 0              # bytes of started, not yet dropped shards
        self.peak_bytes = 0
        self.fetched_shards = 0     # shards this process fetched
        self._done = False
        self._limit = cache_bytes   # bytes held at most besides the shard a read needs
        self.compacted = 0          # shards compacted to their late ranges
        self.early_singles = 0      # early ranges read singly (the cache was full)
        self._largest = 0
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
            self._entries = {s.url: ShardEntry(s) for s in self._order}
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
    def _start(self, entry: ShardEntry) -> None:
        size, url = entry.shard.size, entry.shard.url
        entry.started = True
        self._count += 1
        self._held += size
        entry.held = size
        self.peak_bytes = max(self.peak_bytes, self._held)
        self.fetched_shards += 1
        entry.blocks = [self._get(url, off, min(self.block_bytes, size - off))
                        for off in range(0, size, self.block_bytes)]

    def _ahead(self, needed: ShardEntry) -> None:
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
        out = read_blocks(entry.blocks, self.block_bytes, start, length)
        if entry.left <= 0:
            self._drop(entry)
        return out

    def _read_ranged(self, entry: ShardEntry, url: str, start: int, length: int,
                     ranges: int) -> concurrent.futures.Future[bytes]:
        """A shard with planned ranges: from its first read it counts in the bound as the
        bytes of its ranges still to be read (held as just those bytes, sliced out when
        its blocks arrive), each freed after its last planned read."""
        if not entry.compacted:  # its first read: from now on it counts as its ranges' bytes
            entry.compacted = True
            for r in entry.shard.ranges:
                entry.remaining[r] = entry.remaining.get(r, 0) + 1
            kept_bytes = sum(n for _, n in entry.remaining)
            self._held += kept_bytes - entry.held
            entry.held = kept_bytes
            entry.kept = compact(entry.blocks, self.block_bytes, list(entry.remaining))
            entry.blocks = []
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
        if entry.left <= 0:
            self._drop(entry)
        out = from_kept(self._get, url, entry.kept, start, length, pop=freed)  # type: ignore[arg-type]
        self._ahead(entry)  # the room it freed goes to the next shards now
        return out

    def _drop(self, entry: ShardEntry) -> None:
        self._held -= entry.held
        entry.held = 0
        self._count -= 1
        entry.blocks = []

    def close(self) -> None:
        """Nothing to stop: the blocks are dropped with the cache."""
