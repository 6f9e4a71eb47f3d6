"""The levels of an elastic remainder (core/elastic/remainder.py) under a budget (and a
Pack, planned as the budget of its packs) with ``locality="none"``: strata in cost order.

A level is, per bucket, a list of entries in cost order, kept as runs of the previous
level's list (level 0: the bucket's cost order, one copy per pass). A segment consumes
whole strata (lockstep) or, with policy ``none``, each rank's own members of the strata
of its batches; the strata left, sorted by cost, are the next level's list, cut into
strata of the new ``dp_size`` and packed again (core/budgets/strata.py). O(strata) per
level to describe, O(levels x log) per entry. (A budget under shard locality keeps its
levels as runs, core/elastic/listlevels.py, cut in lockstep.)

Invariants (tests/core/test_budgetremainder.py): those of core/elastic/remainder.py; every new
rank has the same batch count (but for policy ``none``), a multiple of
``accumulation_steps``, every batch within the budget (a sample dearer than it alone).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any, Hashable, Sequence

import numpy as np

from ..budgets.budget import Budget
from ..budgets.budgetplan import BudgetBuckets
from ..budgets.strata import BucketBatches
from ..planning.planrecord import Bins, Plan
from ..policy import PadTo
from ..seed import derive_seed
from .levels import Levels, Runs

__all__ = ["StrataLevels"]


@dataclass(eq=False)
class _Level:
    """One level: its DP layout, kept buckets (indices of the base plan's), schedule."""

    dp: int
    tab: np.ndarray                    # base kept-bucket index of each bucket
    schedule: np.ndarray
    window: np.ndarray
    batches: list[BucketBatches] = field(default_factory=list)  # per bucket
    runs: list[Any] = field(default_factory=list)  # per bucket: its list as runs of the previous level's (or None)


class StrataLevels(Levels):
    """The strata levels of a budget remainder (see the module docstring), from the base plan on."""

    def __init__(self, base: Plan, dss: Sequence[Any], budget: Budget, accumulation_steps: int, seed: int,
                 epoch: int, dp: int) -> None:
        super().__init__(base, dss, budget, accumulation_steps, seed, epoch)
        nb0 = len(base.bucket_table)
        self.levels = [_Level(dp=dp, tab=np.arange(nb0, dtype=np.int64), schedule=base.schedule,
                              window=base.window, batches=list(base.buckets.order.batches), runs=[None] * nb0)]

    def advance(self, seg: Any, dp: int) -> tuple[np.ndarray, list[int]]:
        """Add the level ``seg`` left of the top one, dealt to ``dp`` ranks: (its buckets as base
        kept-bucket indices, steps per bucket)."""
        lv, base = self.top, self.base
        counts = np.asarray([[bb.count(d) for d in range(lv.dp)] for bb in lv.batches], np.int64).reshape(-1, lv.dp)
        # a rank has a bucket's batch w while the batch starts before its last entry
        took = self.took(seg, lambda: np.asarray([np.searchsorted(bb.offsets[:-1], c) for bb, c in
                                                  zip(lv.batches, counts)], np.int64).reshape(-1, lv.dp))
        nxt = _Level(dp=dp, tab=np.zeros(0, np.int64), schedule=np.zeros(0, np.int64),
                     window=np.zeros(0, np.int64))
        tab: list[int] = []
        for b, bb in enumerate(lv.batches):
            cost = self.dss[base.bucket_table[int(lv.tab[b])][0]].cost
            made = self._next_strata(b, bb, counts[b], took[b], dp, cost)
            if made is None:
                continue
            tab.append(int(lv.tab[b]))
            nxt.batches.append(made[0])
            nxt.runs.append(made[1])
        nxt.tab = np.asarray(tab, np.int64)
        self.levels.append(nxt)
        return nxt.tab, [bb.batches for bb in nxt.batches]

    def _next_strata(self, b: int, bb: BucketBatches, counts: np.ndarray, taken: np.ndarray, dp: int,
                     cost: Any) -> tuple[BucketBatches, Runs] | None:
        """What ranks of the top level left of its bucket ``b`` (of which they hold ``counts``
        entries and took ``taken`` batches, per rank), as the next level's list (runs of the
        top level's codes, in cost order) and its batches."""
        lv, levels, base = self.top, self.levels, self.base
        consumed = np.minimum(bb.offsets[np.minimum(taken, bb.batches)], counts)
        lo, hi = int(consumed.min()), int(consumed.max())
        whole = bb.seq[hi:][~bb.copy[hi:]]
        starts, lengths = bb.member_runs(whole)
        singles: list[int] = []
        for kk in range(lo, hi):  # strata some ranks have consumed their members of and others not
            ranks = np.flatnonzero((consumed <= kk) & (kk < counts))
            if ranks.size:
                pos, ps, pad = bb.at(ranks, np.full(ranks.size, kk, np.int64))
                singles += (ps[~pad] * bb.n + pos[~pad]).tolist()
        if singles:
            starts = np.concatenate([starts, np.asarray(singles, np.int64)])
            lengths = np.concatenate([lengths, np.ones(len(singles), np.int64)])
        if not lengths.sum():
            return None
        runs = _cost_ordered(starts, lengths, bb.n, bb.passes)
        j0 = int(lv.tab[b])
        di, key = base.bucket_table[j0]
        order0 = base.buckets.order.orders[j0]
        n0 = base.buckets.order.batches[j0].n

        def sorted_cost(pos: np.ndarray) -> np.ndarray:
            code = _resolve(levels, b, runs.prev(np.asarray(pos, np.int64)))
            return np.asarray(cost[np.asarray(order0[code % n0], np.int64)], np.float64)
        made = BucketBatches(runs.total, 1, dp, sorted_cost,
                             derive_seed(self.seed, self.epoch, base.datasets[di], key, "budget", len(levels)),
                             self.sizing, self.policy.value, True, base.pad_to is PadTo.BATCH, self.accumulation_steps)
        return (made, runs) if made.batches else None

    def rank(self, d: int, table: Sequence[tuple[int, Hashable]]) -> tuple[Any, ...]:
        """(entries per bucket, steps per bucket, where its batches start, the entry order,
        None: no shard-local order, BucketStats) of dp_rank ``d`` of the top level."""
        top, base = self.top, self.base
        counts = np.asarray([bb.count(d) for bb in top.batches], np.int64)
        j0 = top.tab.tolist()
        order = BudgetBuckets(top.batches, [base.buckets.order.orders[j] for j in j0], d,
                              [base.buckets.order.n[j] for j in j0], partial(_resolve, self.levels))
        steps = [bb.batches for bb in top.batches]
        return (counts, steps, Bins([bb.offsets for bb in top.batches]), order, None,
                self.stats(table, [bb.real for bb in top.batches], [bb.planned for bb in top.batches], steps,
                           [False] * len(steps)))


def _cost_ordered(codes: np.ndarray, lengths: np.ndarray, n: int, passes: int) -> Runs:
    """A bucket's entries left, runs of the previous level's codes ``codes`` (``lengths``
    long), as the next level's list: in cost order.

    From level 0 (whose entries are codes ``pass * n + position``, a pass's positions in
    cost order): elementary runs of positions, each with the passes that remain at every
    position of it, listed position after position and, at one position, pass after pass
    (exactly cost order: what a stratum's weight, its last member's cost, needs). From a
    deeper level (one pass): runs of its list indices, which are disjoint.
    """
    if passes == 1:
        order = np.argsort(codes, kind="stable")
        return Runs(lengths[order], codes[order])
    pas, pos = codes // n, codes % n
    cuts = np.unique(np.concatenate([pos, pos + lengths]))
    lo, hi = cuts[:-1], cuts[1:]
    cover = np.zeros((lo.size, passes), bool)
    for p in range(passes):
        mine = pas == p
        if not mine.any():
            continue
        st, en = pos[mine], pos[mine] + lengths[mine]
        o = np.argsort(st, kind="stable")
        st, en = st[o], en[o]
        q = np.searchsorted(st, lo, side="right") - 1
        cover[:, p] = (q >= 0) & (en[np.maximum(q, 0)] > lo)
    keep = cover.any(axis=1)
    lo, hi, cover = lo[keep], hi[keep], cover[keep]
    # the passes present in each run, in order (padded with ``passes``, never read)
    present = np.where(cover, np.arange(passes)[None, :], passes)
    present.sort(axis=1)
    return Runs(hi - lo, lo, mult=cover.sum(axis=1).astype(np.int64), passes=present, n=n)


def _resolve(levels: list[_Level], j: int, idx: np.ndarray) -> np.ndarray:
    """Level-0 codes (``pass * n + cost position``) of entries ``idx`` of bucket ``j`` of
    ``levels[-1]``'s list (locality none)."""
    for at in range(len(levels) - 1, 0, -1):
        lv = levels[at]
        idx = lv.runs[j].prev(np.asarray(idx, np.int64))
        j = int(np.flatnonzero(levels[at - 1].tab == lv.tab[j])[0])
    return idx
