"""What a plan reads: per dataset, where a rank's entries are and how its reader gets them.

The facts the reading cost of a plan (cli/readfigures.py) and the job simulation
(core/local/simulate.py) are computed from, for any locality: a plan without shard-local
buckets (``locality="none"``) reads every entry by one ranged GET; one with them
(``plan.buckets.local``) reads the rank's own shards whole and singly only its foreign
entries and the reads two or more windows before their shard's window, as the reader
does (core/local/shardschedule.py). A node holds the union of the shards its processes read
whole and, with ``locality="node"``, the other nodes' shards it reads.

Invariants:
- pure and O(the shares of the ranks given): from the plans, and per dataset each
  sample's shard and byte length and each shard's bytes, never from reading a shard.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

__all__ = ["IMPORT_READS", "Reads", "dataset_of_entries", "imported", "imports_shards", "node_held", "node_reads",
           "rank_reads", "shard_blocks", "window_lag"]


@dataclass(frozen=True)
class Reads:
    """One rank's entries of one dataset: where they are, and how its reader gets them."""

    entries: np.ndarray      # positions in the rank's entries (batch order)
    shard: np.ndarray        # each entry's shard
    length: np.ndarray       # each entry's bytes
    single: np.ndarray       # bool: read by a single ranged GET
    whole: np.ndarray        # shard numbers the rank reads whole


def dataset_of_entries(plan: Any) -> np.ndarray:
    """The dataset (index in the plan) of every entry of the rank, in batch order."""
    sizes = np.diff(plan.offsets)
    b = np.repeat(plan.schedule[plan.batch_step], sizes)
    ds_of = np.asarray([plan.bucket_table[int(x)][0] for x in range(len(plan.bucket_table))], np.int64)
    return ds_of[b] if b.size else np.zeros(0, np.int64)


def rank_reads(plan: Any, shard_of: Sequence[Any], lengths: Sequence[Any]) -> list[Reads]:
    """Per dataset of ``plan``, the rank's reads (see :class:`Reads`)."""
    samples = plan.samples
    ds_e = dataset_of_entries(plan)
    steps = np.repeat(plan.batch_step, np.diff(plan.offsets))
    local = plan.buckets.local
    out = []
    for di in range(len(plan.datasets)):
        sel = np.flatnonzero(ds_e == di)
        sh = np.asarray(shard_of[di])[samples[sel]].astype(np.int64)
        ln = np.asarray(lengths[di])[samples[sel]].astype(np.int64)
        if local is None:
            out.append(Reads(sel, sh, ln, np.ones(sel.size, bool), np.zeros(0, np.int64)))
            continue
        mine = np.asarray(local.rank_shards(di), dtype=np.int64)
        # an own shard's read two or more windows before its window is read singly
        own = np.isin(sh, mine) & (window_lag(sh, mine, plan.shard_window, local.window_of_step(di, steps[sel])) >= -1)
        out.append(Reads(sel, sh, ln, ~own, mine))
    return out


def window_lag(shards: np.ndarray, visit: np.ndarray, window: int, step_window: np.ndarray) -> np.ndarray:
    """For a rank's own-shard reads: how many windows after its shard's window each read's
    step lies (negative: before it).

    The plan gives window w of the rank's visit order a span of steps, and takes a
    bucket's entries at those steps from w's shards, but for the few that the shards'
    bucket counts cannot match (a bucket with fewer batches than windows, or more
    samples in w than steps for them). The reader holds a shard from its first use
    (fetched ahead) up to its window's end, so a read one window early (lag -1) fetches
    it early and reads from it; reads after its window (lag > 0) come from the few bytes
    kept when it is dropped; reads two or more windows early are single ranged GETs.
    """
    if not shards.size:
        return np.zeros(0, np.int64)
    pos_in_visit = np.zeros(int(max(visit.max(initial=0), shards.max())) + 1, np.int64)
    pos_in_visit[visit] = np.arange(visit.size)
    return step_window - pos_in_visit[shards] // window


def shard_blocks(shard_bytes: Any, shards: np.ndarray, block_bytes: int) -> tuple[int, int]:
    """(GETs, bytes) of fetching ``shards`` whole in blocks of ``block_bytes``."""
    sb = np.asarray(shard_bytes, dtype=np.int64)[shards]
    return int((-(-sb // block_bytes)).sum()), int(sb.sum())


#: With ``locality="node"``, a shard of another node that a node reads this many times or
#: more in an epoch is fetched whole for the node and kept: the samples that cross between
#: nodes come from the same few shards every epoch (the exporting node's export tail),
#: so a shard read even once is read again next epoch, and after the first it costs no GET.
IMPORT_READS = 1


def imported(shards: np.ndarray) -> np.ndarray:
    """The shards (numbers, with repeats: one per read) read at least ``IMPORT_READS`` times."""
    uniq, count = np.unique(np.asarray(shards, np.int64), return_counts=True)
    return uniq[count >= IMPORT_READS]


def node_reads(plans: Sequence[Any], shard_of: Sequence[Any], lengths: Sequence[Any]) -> tuple[list[tuple[list[Reads], int]], bool]:
    """Per distinct plan of a node (CP peers' shared plan once, with their count), its
    reads per dataset; and whether the node imports other nodes' shards (``node``)."""
    counted: dict[int, tuple[Any, int]] = {}
    for p in plans:
        plan, count = counted.get(id(p), (p, 0))
        counted[id(p)] = (plan, count + 1)
    imports = imports_shards([plan for plan, _ in counted.values()])
    return [(rank_reads(plan, shard_of, lengths), count) for plan, count in counted.values()], imports


def imports_shards(plans: Sequence[Any]) -> bool:
    """Whether a node of these plans reads other nodes' shards often enough to keep them
    (``locality="node"``: see IMPORT_READS)."""
    return any(plan.locality == "node" for plan in plans)  # Locality is a str Enum


def node_held(reads: Sequence[list[Reads]], di: int, imports: bool) -> np.ndarray:
    """The shards of dataset ``di`` a node holds in an epoch: those its processes read
    whole and, with ``imports`` (``locality="node"``), the other nodes' shards it reads."""
    held = np.unique(np.concatenate([r[di].whole for r in reads] + [np.zeros(0, np.int64)]))
    if imports:
        held = np.union1d(held, imported(np.concatenate([r[di].shard[r[di].single] for r in reads]
                                                        + [np.zeros(0, np.int64)])))
    return held
