"""What the plan tells the shard cache: one record per planned shard, and the cache's
running account of it.

:class:`PlannedShard` is made by the shard-level path from the plan (one epoch's schedule,
``wds_pad.stream.stages.shard_schedule``); :class:`_Entry` is what a
:class:`~wds_pad.io.shardcache.ShardCache` keeps of each while it serves the epoch.

Invariants:
    * A ``PlannedShard`` is frozen: the plan's word for one epoch, never changed by the
      cache.
    * An ``_Entry`` starts with every planned range of its shard still to serve
      (``left == uses``), its ``skip`` single reads still to skip, nothing held and
      nothing fetched; the cache alone changes it.
"""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass

__all__ = ["PlannedShard"]


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
