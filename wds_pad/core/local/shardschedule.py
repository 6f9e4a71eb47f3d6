"""The per-window shard schedule: which of its own shards a worker reads whole, and when;
and, over a node, every read of every rank of it.

With ``locality="shard"`` a rank reads its own shards whole, a window of them at a time
(core/local/locality.py): the reader fetches a shard ahead of its first use and drops it after
its last. :func:`shard_reads` says, for one epoch of a DataLoader worker's walk through
the plan, which shards those are, in order of first use, with each planned read, as
int64 arrays; the stream side (stream/wholeshards.py ``shard_schedule``) only turns them into
the reader's records (io/shardcache.py ``PlannedShard``).

The processes of a node share one copy of each shard (io/nodecache.py). :func:`node_uses`
says, for one epoch, which shards the node's ranks read, which of them some rank reads
whole (the node keeps a copy: every read of it comes from there), at which steps any rank
of the node reads each one, which processes (local rank, worker) read it, and the reads of
one of them in walk order: what the node cache counts uses and chooses evictions by.

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
  for all workers; pure: the plan in, arrays out, no I/O;
- ``node_uses`` lists every shard any rank of the node reads from the walk's start on,
  once, with its steps sorted and unique; a shard is ``held`` iff the ``shard_reads`` of
  one of the node's DP ranks lists it; O(the node's share) per epoch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import numpy as np

from .reads import IMPORT_READS, dataset_of_entries, imports_shards, window_lag
from ..planning.planrecord import Batch, Plan

__all__ = ["NodeUses", "ShardReads", "node_uses", "shard_reads"]


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
        lag = window_lag(shards, mine_shards, plan.shard_window, local.window_of_step(di, steps))
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
    """The batches ``walk[first:]`` of ``plan``, in blocks (``Plan.iter_batches``) when the walk is a run."""
    if isinstance(walk, range) and walk.step == 1:
        yield from plan.iter_batches(walk.start + first, walk.stop)
        return
    for k in range(first, len(walk)):
        yield plan[int(walk[k])]


class PlannedShardUses:
    """Shard locality of a remainder's Plan, read off the plan itself: what the shard cache
    reads whole (:func:`shard_reads`). O(the rank's share). ``plan`` is set once planned;
    ``shard_map``: per dataset, sample id -> shard (None: not shard-local)."""

    def __init__(self, shard_map: Any) -> None:
        self.plan: Plan | None = None
        self._shard_map = shard_map
        self._uses: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def _shard_uses(self, di: int) -> tuple[np.ndarray, np.ndarray]:
        """This rank's shards of dataset ``di`` read at least twice, in order of first use,
        and the step of each first use. O(the rank's share)."""
        if di not in self._uses:
            plan = self.plan
            assert plan is not None
            sel = np.flatnonzero(dataset_of_entries(plan) == di)
            steps = np.repeat(plan.batch_step, np.diff(plan.offsets))[sel]
            shard = np.asarray(self._shard_map[di][plan.samples[sel]], np.int64)
            uniq, first, cnt = np.unique(shard, return_index=True, return_counts=True)
            many = cnt >= 2  # one read of a shard: a single ranged GET costs less than the shard
            order = np.argsort(first[many], kind="stable")
            self._uses[di] = (uniq[many][order], steps[first[many][order]].astype(np.int64))
        return self._uses[di]

    def rank_shards(self, di: int, d: int | None = None) -> np.ndarray:
        return self._shard_uses(di)[0]

    def window_of_step(self, di: int, steps: np.ndarray, d: int | None = None) -> np.ndarray:
        """The window (of ``rank_shards`` in visit order) that is current at each step: that
        of the first shard first used there, else of the last one first used before."""
        first = self._shard_uses(di)[1]
        steps = np.asarray(steps, np.int64)
        j = np.searchsorted(first, steps, side="left")
        exact = (j < first.size) & (first[np.minimum(j, max(first.size - 1, 0))] == steps) if first.size else j < 0
        at = np.where(exact, j, j - 1)
        window = self.plan.shard_window if self.plan is not None else 1
        return np.maximum(at, 0) // window

    def foreign(self, d: int | None = None) -> int:
        return 0


@dataclass(frozen=True, eq=False)
class NodeUses:
    """Every read the ranks of one node make in one epoch, a row per shard they read.

    Attributes:
        dataset, shard: the shard of each row (rows sorted by shard, then dataset).
        held: some rank of the node reads it whole (its ``shard_reads`` lists it): the
            node keeps one copy of it, and every read of it by the node comes from there.
        bounds, steps: row r is read at the walk positions ``steps[bounds[r]:bounds[r + 1]]``
            (sorted, unique): batch positions of the epoch, the same step on every rank.
        users: (rows, processes) bool: process ``local_rank * num_workers + worker`` reads it.
        mine_bounds, mine_steps: the walk positions of the reads of the process ``me``
            (one per read, in walk order) of each row.
        length: positions in the walk (the epoch's batches on every rank).
    """

    dataset: np.ndarray
    shard: np.ndarray
    held: np.ndarray
    bounds: np.ndarray
    steps: np.ndarray
    users: np.ndarray
    mine_bounds: np.ndarray
    mine_steps: np.ndarray
    length: int

    def __len__(self) -> int:
        return int(self.shard.size)

    def uses(self, r: int) -> np.ndarray:
        """The walk positions at which any rank of the node reads row ``r``."""
        return self.steps[int(self.bounds[r]):int(self.bounds[r + 1])]

    def mine(self, r: int) -> np.ndarray:
        """The walk positions of the reads of process ``me`` of row ``r`` (one per read)."""
        return self.mine_steps[int(self.mine_bounds[r]):int(self.mine_bounds[r + 1])]


def node_uses(plans: Sequence[Plan], local_ranks: Sequence[Sequence[int]], first: int, counter: int,
              num_workers: int, me: tuple[int, int, int], shard_of: Sequence[Any]) -> NodeUses:
    """Every read of the ranks of one node in one epoch, from walk position ``first`` on.

    Args:
        plans: per DP rank of the node, its plan of the epoch (or of the epoch's elastic
            remainder), each walked whole from ``first`` (the ranks are in lockstep).
        local_ranks: per plan, the node's local ranks (0 .. processes per node - 1) that
            read it: its own rank and its context-parallel peers.
        counter: batches walked before this epoch (worker w reads the batches with
            counter mod num_workers == w), the same on every rank.
        num_workers: DataLoader workers per rank (1: the rank reads in its main process).
        me: (plan, local rank, worker) of the process whose own reads ``mine`` lists.
        shard_of: per dataset, the shard number of each sample id.

    Returns:
        The node's reads (see :class:`NodeUses`).
    """
    nd = max(1, len(shard_of))
    nw = max(1, int(num_workers))
    keys, pos, procs, held = [], [], [], []
    mine_keys, mine_pos = np.zeros(0, np.int64), np.zeros(0, np.int64)
    length = 0
    for i, plan in enumerate(plans):
        n = len(plan)
        length = max(length, n)
        if first >= n:
            continue
        sizes = np.diff(plan.offsets)[first:]
        ds = dataset_of_entries(plan)[int(plan.offsets[first]):]
        samples = plan.samples[int(plan.offsets[first]):]
        shard = np.empty(samples.size, np.int64)
        for di in np.unique(ds).tolist():
            sel = ds == di
            shard[sel] = np.asarray(shard_of[di][samples[sel]], np.int64)
        key = shard * nd + ds
        at = np.repeat(np.arange(first, n, dtype=np.int64), sizes)
        worker = (counter + at - first) % nw
        for r in local_ranks[i]:
            keys.append(key)
            pos.append(at)
            procs.append(int(r) * nw + worker)
        if i == me[0]:
            own = worker == me[2]
            mine_keys, mine_pos = key[own], at[own]
        reads, _ = shard_reads(plan, range(n), first, 0, 1, 0, shard_of)
        held.append(reads.shard * nd + reads.dataset)
    key = np.concatenate(keys) if keys else np.zeros(0, np.int64)
    at = np.concatenate(pos) if pos else np.zeros(0, np.int64)
    proc = np.concatenate(procs) if procs else np.zeros(0, np.int64)
    rows = np.unique(key)
    span = max(length, 1)
    pairs = np.unique(np.searchsorted(rows, key) * span + at)
    row_of_pair = pairs // span
    bounds = np.searchsorted(row_of_pair, np.arange(rows.size + 1)).astype(np.int64)
    top = max((int(r) for ranks in local_ranks for r in ranks), default=0)
    users = np.zeros((rows.size, (top + 1) * nw), bool)
    users[np.searchsorted(rows, key), proc] = True
    order = np.argsort(mine_keys, kind="stable")  # each row's reads, in walk order
    mine_rows = np.searchsorted(rows, mine_keys[order])
    mine_bounds = np.searchsorted(mine_rows, np.arange(rows.size + 1)).astype(np.int64)
    whole = np.isin(rows, np.concatenate(held)) if held else np.zeros(rows.size, bool)
    if imports_shards(plans):
        # another node's shard read at several steps is fetched whole and kept (the same few
        # every epoch): core/local/reads.py IMPORT_READS
        whole |= np.diff(bounds) >= IMPORT_READS
    return NodeUses(dataset=rows % nd, shard=rows // nd, held=whole,
                    bounds=bounds, steps=(pairs % span).astype(np.int64), users=users,
                    mine_bounds=mine_bounds, mine_steps=mine_pos[order].astype(np.int64), length=int(length))
