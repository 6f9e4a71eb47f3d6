"""What the plan tells the shard caches: one record per planned shard, and the cache's
running account of it.

:class:`PlannedShard` is made by the shard-level path from the plan (one epoch's schedule,
``wds_pad.stream.wholeshards.shard_schedule``); :class:`ShardEntry` is what a
:class:`~wds_pad.io.shardcache.ShardCache` keeps of each while it serves the epoch.
:class:`NodeEpoch` (of :class:`NodeShard` records) is what the node's plans say of one
epoch (``wds_pad.stream.wholeshards.node_schedule``), for the node cache
(:mod:`wds_pad.io.nodecache`), which keeps a :class:`NodeEntry` of each.

Invariants:
    * ``PlannedShard``, ``NodeShard`` and ``NodeEpoch`` are frozen: the plan's word for one
      epoch, never changed by a cache.
    * An ``ShardEntry`` starts with every planned range of its shard still to serve
      (``left == uses``), its ``skip`` single reads still to skip, nothing held and
      nothing fetched; the cache alone changes it.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

__all__ = ["NodeEpoch", "NodeShard", "PlannedShard"]


@dataclass(frozen=True)
class PlannedShard:
    """One shard of a stream's schedule for one epoch.

    Attributes:
        url: the shard URL.
        size: its size in bytes (from the index).
        uses: ranges this stream reads from it this epoch.
        users: the DataLoader workers (of this rank) that read from it this epoch.
        key: the plan fingerprint, epoch and rank it was planned under.
        skip: ranges of it this stream reads singly before the ``uses`` cached ones (uses
            far before its window's time, so the shard is not held long for them).
        ranges: (start, length) of its cached ranges. From its first read the shard
            counts in the bound as the bytes of these ranges still to be read, each freed
            after its last planned read, so the room goes to the shards fetched next; it is
            held as just those bytes (sliced out when its blocks arrive, the blocks dropped). Empty: held (and counted) whole until its last range.
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


@dataclass(frozen=True, eq=False)
class NodeShard:
    """One shard the ranks of a node read in an epoch.

    Attributes:
        url: the shard URL.
        size: its size in bytes (from the index).
        name: the stem of its files, from its URL, size, change stamp and content
            (:func:`wds_pad.io.nodefiles.shard_name`).
        held: the node keeps a copy of it this epoch (some rank of the node reads it
            whole): every read of it comes from there.
        steps: the steps at which any process of the node reads it (sorted).
        users: the processes of the node that read it (``local rank x workers + worker``).
        mine: the steps of this process's reads of it, one per read, in order.
        content: the index's identity of its bytes (``ShardInfo.content``), or ``""``:
            a copy fetched whose checksum differs is the store's, not the indexed shard.
    """

    url: str
    size: int
    name: str
    held: bool
    steps: np.ndarray
    users: frozenset[int]
    mine: np.ndarray
    content: str = ""


@dataclass(frozen=True, eq=False)
class NodeEpoch:
    """What the plans of a node's ranks say of one epoch, for one process of the node.

    Attributes:
        epoch: the epoch.
        length: its steps (batches of every rank).
        me: this process (``local rank x workers + worker``).
        shards: every shard the node reads in the epoch, by URL.
        order: the held shards this process reads, in order of its first read of each.
        later: the file stem of every shard the node holds in the next epoch, with the
            first step it reads it at: such a shard is kept after this epoch's last read.
        span: about the steps of one window of the plan: reads of a shard closer than this
            are one visit of it.
    """

    epoch: int
    length: int
    me: int
    shards: dict[str, NodeShard]
    order: tuple[str, ...]
    later: Mapping[str, int]
    span: int = 1


class ShardEntry:
    __slots__ = ("shard", "blocks", "left", "started", "skip", "served", "kept", "held",
                 "compacted", "remaining")

    def __init__(self, shard: PlannedShard) -> None:
        self.shard = shard
        self.blocks: list[concurrent.futures.Future[bytes]] = []
        self.left = shard.uses
        self.started = False
        self.skip = shard.skip
        self.served = 0
        # compacted: the late ranges' bytes, once the blocks have arrived
        self.kept: concurrent.futures.Future[dict[tuple[int, int], bytes]] | None = None
        self.held = 0            # the bytes it counts in the bound: its size, then its ranges' still to come
        self.compacted = False
        self.remaining: dict[tuple[int, int], int] = {}  # sliced: planned reads left per range


class NodeEntry:
    """What a :class:`~wds_pad.io.nodecache.NodeCache` keeps of a shard the node reads in an epoch."""

    __slots__ = ("shard", "epoch", "seen", "fd", "complete", "fetch", "present", "finished")

    def __init__(self, shard: NodeShard, epoch: NodeEpoch) -> None:
        self.shard, self.epoch = shard, epoch
        self.seen = 0               # this process's planned reads of it counted so far
        self.fd: int | None = None  # the read thread's descriptor of its copy
        self.complete = False
        self.fetch: concurrent.futures.Future[str] | None = None
        self.present: bool | None = None  # a shard not held: is a complete copy here?
        self.finished = False       # this process's planned reads of it are all counted
