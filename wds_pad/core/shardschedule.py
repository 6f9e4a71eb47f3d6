"""The per-window shard schedule: which of its own shards a worker reads whole, and when.

With ``locality="shard"`` a rank reads its own shards whole, a window of them at a time
(core/locality.py): the reader fetches a shard ahead of its first use and drops it after
its last. :func:`shard_reads` says, for one epoch of a DataLoader worker's walk through
the plan, which shards those are, in order of first use, with each planned read, as
int64 arrays; the stream side (stream/stages.py ``shard_schedule``) only turns them into
the reader's records (io/shardcache.py ``PlannedShard``).

Invariants:
- a shard is listed once per epoch per worker, after its first use; its reads are the
  worker's own reads of it in walk order, but for those two or more windows before the
  shard's window (``skip``: they lead, along the walk the lag only grows), which are
  single ranged reads; a shard whose first such read lies after its window (a resumed
  stream) is not listed: its reads are single too;
- ``users`` are the workers that read the shard from its window on (or one window
  early): the reader drops it after the last of them; foreign samples (shards dealt to
  other ranks) are never listed;
- O(the rank's share) per epoch: every batch of the walk is evaluated once, in blocks,
  for all workers; pure: the plan in, arrays out, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import numpy as np

from .planrecord import Batch, Plan

__all__ = ["ShardReads", "shard_reads"]


@dataclass(frozen=True, eq=False)
class ShardReads:
    """One worker's whole-shard reads in one epoch, a row per shard in order of first use.

    Attributes:
        dataset: the dataset (index in the plan) of each shard.
        shard: its shard number.
        first: the walk position (entries over every dataset and worker) of its first read.
        skip: the worker's reads of it before ``first`` (two or more windows early: single).
        early: of its reads, those before its window (it is fetched one window early).
        users: (rows, num_workers) bool: the workers that read it from one window early on.
        bounds: row r's reads are ``samples[bounds[r]:bounds[r + 1]]``.
        samples: the sample ids of every row's reads, in walk order.
    """

    dataset: np.ndarray
    shard: np.ndarray
    first: np.ndarray
    skip: np.ndarray
    early: np.ndarray
    users: np.ndarray
    bounds: np.ndarray
    samples: np.ndarray

    def __len__(self) -> int:
        return int(self.shard.size)

    def uses(self, r: int) -> np.ndarray:
        """The sample ids row ``r`` reads from its shard, in walk order."""
        return self.samples[int(self.bounds[r]):int(self.bounds[r + 1])]


def shard_reads(plan: Plan, walk: Sequence[int], first: int, counter: int, num_workers: int, worker: int,
                shard_of: Sequence[Any]) -> tuple[ShardReads, int]:
    """The shards ``worker`` of ``num_workers`` reads whole in the epoch of ``plan``.

    Args:
        plan: the epoch's plan (or its elastic remainder) of this rank.
        walk: the plan's batches the stream walks, in order; ``first``: where it starts.
        counter: batches walked before this epoch (worker w takes those with
            counter mod num_workers == w).
        num_workers, worker: the DataLoader workers and this one.
        shard_of: per dataset, the shard number of each sample id (an index's shard column).

    Returns:
        The reads, and ``counter`` after the epoch.
    """
    local = plan.buckets.local
    rows: list[tuple[int, int, int, list[int], int, int, np.ndarray]] = []
    if local is None:  # every sample a single ranged read: nothing is held
        return _table(rows, num_workers), counter + max(0, len(walk) - first)
    picks: dict[int, list[tuple[np.ndarray, int, int, int]]] = {}
    at = 0  # position in the walk, over every dataset and worker
    for batch in _walked(plan, walk, first):
        picks.setdefault(plan.datasets.index(batch.dataset), []).append(
            (batch.samples, counter % num_workers, at, batch.step))
        at += batch.samples.size
        counter += 1
    for di, items in picks.items():
        samples = np.concatenate([s for s, _, _, _ in items])
        sizes = [s.size for s, _, _, _ in items]
        workers = np.repeat([w for _, w, _, _ in items], sizes)
        steps = np.repeat([t for _, _, _, t in items], sizes)
        where = np.concatenate([a + np.arange(s.size) for s, _, a, _ in items])
        shards = np.asarray(shard_of[di][samples], dtype=np.int64)
        mine_shards = local.rank_shards(di)
        own = np.isin(shards, mine_shards)
        shards, workers, where, steps, samples = (
            shards[own], workers[own], where[own], steps[own], samples[own])
        lag = _window_lag(shards, mine_shards, plan.shard_window, local.window_of_step(di, steps))
        by_shard = np.argsort(shards, kind="stable")  # each shard's uses, in walk order
        for grp in np.split(by_shard, np.flatnonzero(np.diff(shards[by_shard])) + 1) if shards.size else ():
            mine = grp[workers[grp] == worker]  # this worker's uses, in order
            # uses two or more windows before the shard's own are read singly: along the
            # walk the lag only grows, so they lead
            lo = int(np.searchsorted(lag[mine], -1, side="left"))
            held = mine[lo:]
            if not held.size or lag[held[0]] > 0:
                continue  # none left, or only reads after its window (a resumed stream): singly
            users = np.unique(workers[grp[lag[grp] >= -1]]).tolist()
            rows.append((int(where[held[0]]), di, int(shards[grp[0]]), users, lo,
                         int(np.searchsorted(lag[held], 0, side="left")), samples[held]))
    rows.sort(key=lambda t: t[0])
    return _table(rows, num_workers), counter


def _table(rows: list[tuple[int, int, int, list[int], int, int, np.ndarray]], num_workers: int) -> ShardReads:
    users = np.zeros((len(rows), num_workers), bool)
    for r, row in enumerate(rows):
        users[r, row[3]] = True
    bounds = np.zeros(len(rows) + 1, np.int64)
    np.cumsum([row[6].size for row in rows], out=bounds[1:])
    col = (lambda k: np.asarray([row[k] for row in rows], np.int64))
    return ShardReads(dataset=col(1), shard=col(2), first=col(0), skip=col(4), early=col(5), users=users,
                      bounds=bounds, samples=np.concatenate([row[6] for row in rows]).astype(np.int64)
                      if rows else np.zeros(0, np.int64))


def _walked(plan: Plan, walk: Sequence[int], first: int) -> Iterator[Batch]:
    """The batches ``walk[first:]`` of ``plan``, computed in blocks of about 64K entries
    when the walk is the whole plan (one permutation pass per block, not per batch)."""
    if isinstance(walk, range) and walk.step == 1 and hasattr(plan, "batches"):
        block = max(1, 65536 // max(plan.batch_size, 1))
        for lo in range(walk.start + first, walk.stop, block):
            yield from plan.batches(lo, min(lo + block, walk.stop))
        return
    for k in range(first, len(walk)):
        yield plan[int(walk[k])]


def _window_lag(shards: np.ndarray, visit: np.ndarray, window: int, step_window: np.ndarray) -> np.ndarray:
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
