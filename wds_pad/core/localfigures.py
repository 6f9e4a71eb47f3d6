"""What a plan costs to read: the figures of ``wds-pad plan --summary`` for either locality.

Invariants:
- pure and O(the rank's share): from the plan, and per dataset each sample's shard and
  byte length and each shard's bytes, never from reading a shard;
- with ``locality="none"`` every entry is one ranged read; with ``shard`` a rank reads
  its own shards whole (in blocks of ``block_bytes``) and singly only its foreign
  entries and the reads two or more windows before their shard's window, as the reader
  does (core/shardschedule.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

__all__ = ["LocalityFigures", "figures"]


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

    @property
    def foreign_fraction(self) -> float:
        return self.single / self.entries if self.entries else 0.0


def figures(plan: Any, shard_of: Sequence[Any], lengths: Sequence[Any], shard_bytes: Sequence[Any],
            block_bytes: int) -> LocalityFigures:
    """The reading cost of ``plan`` (either locality) given per dataset the shard and the
    byte length of every sample and the bytes of every shard. O(the rank's share)."""
    samples = plan.samples
    sizes = np.diff(plan.offsets)
    b = np.repeat(plan.schedule[plan.batch_step], sizes)
    ds_of = np.asarray([plan.bucket_table[int(x)][0] for x in range(len(plan.bucket_table))], np.int64)
    ds_e = ds_of[b] if b.size else np.zeros(0, np.int64)
    shards = single = gets = read = used = 0
    distinct = 0
    batch_of = np.repeat(np.arange(len(plan), dtype=np.int64), sizes)
    local = plan.buckets.local
    for di in range(len(plan.datasets)):
        sel = np.flatnonzero(ds_e == di)
        sh = np.asarray(shard_of[di])[samples[sel]].astype(np.int64)
        ln = np.asarray(lengths[di])[samples[sel]].astype(np.int64)
        used += int(ln.sum())
        # distinct shards per batch
        key = np.unique(batch_of[sel] * (int(sh.max()) + 1 if sh.size else 1) + sh)
        distinct += key.size
        if local is None:
            single += sel.size
            gets += sel.size
            read += int(ln.sum())
            continue
        mine = local.rank_shards(di)
        own = np.isin(sh, mine)
        # an own shard's read two or more windows before its window is read singly (the
        # reader holds a shard from one window early, and keeps bytes for later reads)
        where = np.zeros(int(max(mine.max(initial=0), sh.max(initial=0))) + 1, np.int64)
        where[mine] = np.arange(mine.size) // plan.shard_window
        steps = np.repeat(plan.batch_step, sizes)[sel]
        own &= local.window_of_step(di, steps) - where[sh] >= -1
        sb = np.asarray(shard_bytes[di], dtype=np.int64)[mine]
        shards += int(mine.size)
        single += int((~own).sum())
        gets += int((-(-sb // block_bytes)).sum()) + int((~own).sum())
        read += int(sb.sum()) + int(ln[~own].sum())
    return LocalityFigures(shards=shards, entries=int(samples.size), single=single,
                           distinct_per_batch=distinct / max(len(plan), 1), gets=gets,
                           bytes_read=read, bytes_used=used,
                           foreign=local.foreign() if local is not None else 0)
