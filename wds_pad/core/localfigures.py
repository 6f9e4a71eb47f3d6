"""What a plan costs to read: the figures of ``wds-pad plan --summary`` for any locality.

Two figures per epoch: one rank's reads as its reader makes them alone (:func:`figures`),
and one node's when its processes share one copy of each shard (:func:`node_figures`,
the node cache): every shard a process of the node reads whole is fetched once for the
node, and a sample read singly from such a shard is served by that copy.

Invariants:
- pure and O(the shares of the ranks given): from the plans, and per dataset each
  sample's shard and byte length and each shard's bytes, never from reading a shard;
- a plan without shard-local buckets (``locality="none"``) reads every entry by one
  ranged GET; one with them (``plan.buckets.local``: ``shard``, and any locality that
  deals shards to ranks) reads the rank's own shards whole (in blocks of ``block_bytes``)
  and singly only its foreign entries and the reads two or more windows before their
  shard's window, as the reader does (core/shardschedule.py);
- a node holds the union of the shards its processes read whole; its GETs are their
  blocks, once, plus the single reads of shards it does not hold, each process's own
  (context-parallel peers included: a process reads what its plan says);
- the shuffle quality is Mosaic Streaming's measure (core/shufflequality.py) over the
  rank's entries in the order it yields them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from .shufflequality import shuffle_quality

__all__ = ["LocalityFigures", "NodeFigures", "figures", "node_figures", "node_held", "node_reads"]


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


@dataclass(frozen=True)
class _Reads:
    """One rank's entries of one dataset: where they are, and how its reader gets them."""

    entries: np.ndarray      # positions in the rank's entries (batch order)
    shard: np.ndarray        # each entry's shard
    length: np.ndarray       # each entry's bytes
    single: np.ndarray       # bool: read by a single ranged GET
    whole: np.ndarray        # shard numbers the rank reads whole


def _dataset_of_entries(plan: Any) -> np.ndarray:
    """The dataset (index in the plan) of every entry of the rank, in batch order."""
    sizes = np.diff(plan.offsets)
    b = np.repeat(plan.schedule[plan.batch_step], sizes)
    ds_of = np.asarray([plan.bucket_table[int(x)][0] for x in range(len(plan.bucket_table))], np.int64)
    return ds_of[b] if b.size else np.zeros(0, np.int64)


def _reads(plan: Any, shard_of: Sequence[Any], lengths: Sequence[Any]) -> list[_Reads]:
    """Per dataset of ``plan``, the rank's reads (see :class:`_Reads`)."""
    samples = plan.samples
    ds_e = _dataset_of_entries(plan)
    steps = np.repeat(plan.batch_step, np.diff(plan.offsets))
    local = plan.buckets.local
    out = []
    for di in range(len(plan.datasets)):
        sel = np.flatnonzero(ds_e == di)
        sh = np.asarray(shard_of[di])[samples[sel]].astype(np.int64)
        ln = np.asarray(lengths[di])[samples[sel]].astype(np.int64)
        if local is None:
            out.append(_Reads(sel, sh, ln, np.ones(sel.size, bool), np.zeros(0, np.int64)))
            continue
        mine = np.asarray(local.rank_shards(di), dtype=np.int64)
        own = np.isin(sh, mine)
        # an own shard's read two or more windows before its window is read singly (the
        # reader holds a shard from one window early, and keeps bytes for later reads)
        where = np.zeros(int(max(mine.max(initial=0), sh.max(initial=0))) + 1, np.int64)
        where[mine] = np.arange(mine.size) // plan.shard_window
        own &= local.window_of_step(di, steps[sel]) - where[sh] >= -1
        out.append(_Reads(sel, sh, ln, ~own, mine))
    return out


def _blocks(shard_bytes: Any, shards: np.ndarray, block_bytes: int) -> tuple[int, int]:
    """(GETs, bytes) of fetching ``shards`` whole in blocks of ``block_bytes``."""
    sb = np.asarray(shard_bytes, dtype=np.int64)[shards]
    return int((-(-sb // block_bytes)).sum()), int(sb.sum())


def figures(plan: Any, shard_of: Sequence[Any], lengths: Sequence[Any], shard_bytes: Sequence[Any],
            block_bytes: int) -> LocalityFigures:
    """The reading cost of ``plan`` (any locality) given per dataset the shard and the
    byte length of every sample and the bytes of every shard. O(the rank's share)."""
    return _figures(plan, _reads(plan, shard_of, lengths), shard_of, shard_bytes, block_bytes)


def _figures(plan: Any, reads: list[_Reads], shard_of: Sequence[Any], shard_bytes: Sequence[Any],
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
        blocks, nbytes = _blocks(shard_bytes[di], r.whole, block_bytes)
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


#: With ``locality="node"``, a shard of another node that a node reads this many times or
#: more in an epoch is fetched whole for the node and kept: the samples that cross between
#: nodes come from the same few shards every epoch (the exporting node's export tail),
#: so a shard read even once is read again next epoch, and after the first it costs no GET.
IMPORT_READS = 1


def imported(shards: np.ndarray) -> np.ndarray:
    """The shards (numbers, with repeats: one per read) read at least ``IMPORT_READS`` times."""
    uniq, count = np.unique(np.asarray(shards, np.int64), return_counts=True)
    return uniq[count >= IMPORT_READS]


def node_reads(plans: Sequence[Any], shard_of: Sequence[Any], lengths: Sequence[Any]) -> tuple[list[tuple[list[_Reads], int]], bool]:
    """Per distinct plan of a node (CP peers' shared plan once, with their count), its
    reads per dataset; and whether the node imports other nodes' shards (``node``)."""
    counted: dict[int, tuple[Any, int]] = {}
    for p in plans:
        plan, count = counted.get(id(p), (p, 0))
        counted[id(p)] = (plan, count + 1)
    imports = any(getattr(getattr(plan, "locality", None), "value", None) == "node" for plan, _ in counted.values())
    return [(_reads(plan, shard_of, lengths), count) for plan, count in counted.values()], imports


def node_held(reads: Sequence[list[_Reads]], di: int, imports: bool) -> np.ndarray:
    """The shards of dataset ``di`` a node holds in an epoch: those its processes read
    whole and, with ``imports`` (``locality="node"``), the other nodes' shards it reads."""
    held = np.unique(np.concatenate([r[di].whole for r in reads] + [np.zeros(0, np.int64)]))
    if imports:
        held = np.union1d(held, imported(np.concatenate([r[di].shard[r[di].single] for r in reads]
                                                        + [np.zeros(0, np.int64)])))
    return held


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
        gets += _blocks(shard_bytes[di], held, block_bytes)[0]
        for r, count in reads:
            inside = np.isin(r[di].shard[r[di].single], held)
            single += count * int((~inside).sum())
            served += count * int(inside.sum())
            alone += count * (_blocks(shard_bytes[di], r[di].whole, block_bytes)[0] + int(r[di].single.sum()))
    return NodeFigures(processes=len(plans), shards=shards, gets=gets + single, single=single,
                       served=served, alone=alone)
