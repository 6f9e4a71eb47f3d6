"""What a plan costs to read: the figures of ``wds-pad plan --summary`` for any locality.

Two figures per epoch: one rank's reads as its reader makes them alone (:func:`figures`),
and one node's when its processes share one copy of each shard (:func:`node_figures`,
the node cache): every shard a process of the node reads whole is fetched once for the
node, and a sample read singly from such a shard is served by that copy. What a plan
reads (which entries singly, which shards whole) is core/local/reads.py's; this module
counts it, beside the commands that print it (cli/reading.py).

Invariants:
- pure and O(the shares of the ranks given), from the plans and per dataset each
  sample's shard and byte length and each shard's bytes, never from reading a shard;
- a node's GETs are the blocks of the shards it holds, once, plus the single reads of
  shards it does not hold, each process's own (context-parallel peers included: a
  process reads what its plan says);
- the shuffle quality is Mosaic Streaming's measure (cli/shufflequality.py) over the
  rank's entries in the order it yields them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from ..core.local.reads import Reads, node_held, node_reads, rank_reads, shard_blocks
from .shufflequality import shuffle_quality

__all__ = ["LocalityFigures", "NodeFigures", "figures", "node_figures"]


@dataclass(frozen=True)
class LocalityFigures:
    """What a plan costs to read, for one rank and one epoch (``wds-pad plan --summary``)."""

    shards: int              # shards read whole
    entries: int             # samples the rank yields (padded copies included)
    single: int              # entries read by a single ranged GET (foreign, 2+ windows early, or all with none)
    distinct_per_batch: float
    gets: int                # GETs per epoch: whole shards in blocks + single reads
    bytes_read: int
    bytes_used: int
    foreign: int = 0         # of ``single``: samples of other ranks' shards (the rebalance)
    shuffle_quality: float = 0.0  # Mosaic Streaming's entropy measure of the rank's order, in bits

    @property
    def foreign_fraction(self) -> float:
        return self.single / self.entries if self.entries else 0.0


@dataclass(frozen=True)
class NodeFigures:
    """What one node's epoch costs to read when its processes share one copy of each shard."""

    processes: int           # the node's processes (plans given; CP peers each count)
    shards: int              # shards the node holds: read whole by any of its processes
    gets: int                # GETs per epoch: the held shards in blocks, once, + ``single``
    single: int              # single reads of shards the node does not hold (each process's own)
    served: int              # single reads served by the node's copy (no GET)
    alone: int               # GETs the same processes make per epoch without sharing

    @property
    def gets_per_shard(self) -> float | None:
        """GETs per shard the node holds (None when it holds none: every read is single)."""
        return self.gets / self.shards if self.shards else None


def figures(plan: Any, shard_of: Sequence[Any], lengths: Sequence[Any], shard_bytes: Sequence[Any],
            block_bytes: int) -> LocalityFigures:
    """The reading cost of ``plan`` (any locality) given per dataset the shard and the
    byte length of every sample and the bytes of every shard. O(the rank's share)."""
    return _figures(plan, rank_reads(plan, shard_of, lengths), shard_of, shard_bytes, block_bytes)


def _figures(plan: Any, reads: list[Reads], shard_of: Sequence[Any], shard_bytes: Sequence[Any],
             block_bytes: int) -> LocalityFigures:
    shards = single = gets = read = used = distinct = 0
    batch_of = np.repeat(np.arange(len(plan), dtype=np.int64), np.diff(plan.offsets))
    # the rank's order over every dataset: sample and shard indices offset past the earlier datasets'
    n = int(plan.samples.size)
    sample_at, shard_at = np.zeros(n, np.int64), np.zeros(n, np.int64)
    sample_base = shard_base = 0
    for di, r in enumerate(reads):
        used += int(r.length.sum())
        key = np.unique(batch_of[r.entries] * (int(r.shard.max()) + 1 if r.shard.size else 1) + r.shard)
        distinct += key.size
        blocks, nbytes = shard_blocks(shard_bytes[di], r.whole, block_bytes)
        shards += int(r.whole.size)
        single += int(r.single.sum())
        gets += blocks + int(r.single.sum())
        read += nbytes + int(r.length[r.single].sum())
        sample_at[r.entries] = sample_base + plan.samples[r.entries]
        shard_at[r.entries] = shard_base + r.shard
        sample_base += len(shard_of[di])
        shard_base += len(shard_bytes[di])
    local = plan.buckets.local
    return LocalityFigures(shards=shards, entries=n, single=single,
                           distinct_per_batch=distinct / max(len(plan), 1), gets=gets,
                           bytes_read=read, bytes_used=used,
                           foreign=local.foreign() if local is not None else 0,
                           shuffle_quality=shuffle_quality(sample_at, shard_at))


def node_figures(plans: Sequence[Any], shard_of: Sequence[Any], lengths: Sequence[Any],
                 shard_bytes: Sequence[Any], block_bytes: int) -> NodeFigures:
    """The reading cost of one node's epoch when its processes share one copy of each shard.

    Args:
        plans: the plan of every process of the node, one per rank (context-parallel
            peers may pass the same plan object: it is evaluated once).
        shard_of, lengths, shard_bytes, block_bytes: as for :func:`figures`.

    Returns:
        The shards the node holds (read whole by any of its processes), its GETs (those
        shards' blocks once, plus each process's single reads of shards it does not
        hold), the single reads its copy serves, and the GETs of the same processes alone.
    """
    reads, imports = node_reads(plans, shard_of, lengths)
    gets = shards = single = served = alone = 0
    for di in range(len(shard_of)):
        held = node_held([r for r, _ in reads], di, imports)
        shards += int(held.size)
        gets += shard_blocks(shard_bytes[di], held, block_bytes)[0]
        for r, count in reads:
            inside = np.isin(r[di].shard[r[di].single], held)
            single += count * int((~inside).sum())
            served += count * int(inside.sum())
            alone += count * (shard_blocks(shard_bytes[di], r[di].whole, block_bytes)[0] + int(r[di].single.sum()))
    return NodeFigures(processes=len(plans), shards=shards, gets=gets + single, single=single,
                       served=served, alone=alone)
