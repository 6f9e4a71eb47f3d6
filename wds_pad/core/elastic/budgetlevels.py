"""The levels of an elastic remainder (core/elastic/remainder.py) under a budget (and a
Pack, planned as the budget of its packs): strata, or each rank's entries.

- ``locality="none"``: a level is, per bucket, a list of entries in cost order, kept as
  runs of the previous level's list (level 0: the bucket's cost order, one copy per pass).
  A segment consumes whole strata (lockstep) or, with policy ``none``, each rank's own
  members of the strata of its batches; the strata left, sorted by cost, are the next
  level's list, cut into strata of the new ``dp_size`` and packed again
  (core/budgets/strata.py). O(strata) per level to describe, O(levels x log) per entry.
- ``locality="shard"``: a level is, per bucket, each rank's entries explicitly; what the
  old ranks left of theirs, rank after rank, is dealt to the new ranks in contiguous
  blocks (so a new rank reads the remaining samples of a few old ranks' shards) and cut
  in lockstep again (core/budgets/budgetplan.py). O(samples) per level, like the plan it resumes.

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
from ..budgets.budgetplan import BudgetBuckets, RankCuts, lockstep_cuts, shard_cut
from ..planning.planrecord import Bins, Plan, rank_batches
from ..policy import Policy, PadTo
from ..seed import derive_seed, json_digest
from ..local.shardschedule import PlannedShardUses
from ..budgets.strata import BucketBatches
from .countlevels import Levels

__all__ = ["BudgetLevels"]


@dataclass(eq=False)
class _Level:
    """One level: its DP layout, kept buckets (indices of the base plan's), schedule."""

    dp: int
    tab: np.ndarray                    # base kept-bucket index of each bucket
    schedule: np.ndarray
    window: np.ndarray
    batches: list[Any] = field(default_factory=list)    # per bucket: BucketBatches (none) or RankCuts (shard)
    runs: list[Any] = field(default_factory=list)       # per bucket: (run starts, run sources) or None


class BudgetLevels(Levels):
    """The levels of a budget remainder (see the module docstring), from the base plan on."""

    def __init__(self, base: Plan, dss: Sequence[Any], budget: Budget, accumulation_steps: int, seed: int,
                 epoch: int, dp: int) -> None:
        super().__init__(base, dss, budget, accumulation_steps, seed, epoch)
        self.budget = budget
        self.shard = base.locality.dealt
        self.pol = "none" if base.policy is Policy.NONE else "cyclic"
        nb0 = len(base.bucket_table)
        lv0 = _Level(dp=dp, tab=np.arange(nb0, dtype=np.int64), schedule=base.schedule, window=base.window)
        if self.shard:
            local = base.buckets.local
            for j, (di, key) in enumerate(base.bucket_table):
                st = self.stats0[j]
                lv0.batches.append(shard_cut(local, j, st.padded_length, min(st.length, st.padded_length), lv0.dp,
                                             dss[di].cost, budget, accumulation_steps))
        else:
            lv0.batches = list(base.buckets.order.batches)
        lv0.runs = [None] * nb0
        self.levels = [lv0]

    def steps(self) -> list[int]:
        return [bb.batches for bb in self.top.batches]

    def advance(self, seg: Any, dp: int) -> tuple[np.ndarray, list[int]]:
        """Add the level ``seg`` left of the top one, dealt to ``dp`` ranks: (its buckets as base
        kept-bucket indices, steps per bucket)."""
        lv, base, shard = self.top, self.base, self.shard
        counts = np.asarray([[bb.count(d) for d in range(lv.dp)] for bb in lv.batches], np.int64).reshape(-1, lv.dp)
        if seg.steps is not None:
            took = np.repeat(self.taken(seg)[:, None], lv.dp, axis=1)
        else:
            took = self._positions(lv, seg, counts)
        nxt = _Level(dp=dp, tab=np.zeros(0, np.int64), schedule=np.zeros(0, np.int64),
                     window=np.zeros(0, np.int64))
        tab: list[int] = []
        for b, bb in enumerate(lv.batches):
            di = base.bucket_table[int(lv.tab[b])][0]
            if shard:
                made = _next_shard(bb, took[b], dp, self.dss[di].cost, self.budget, self.accumulation_steps,
                                   self.pol)
            else:
                made = self._next_strata(b, bb, took[b], dp, self.dss[di].cost)
            if made is None:
                continue
            tab.append(int(lv.tab[b]))
            nxt.batches.append(made[0])
            nxt.runs.append(made[1])
        nxt.tab = np.asarray(tab, np.int64)
        self.levels.append(nxt)
        return nxt.tab, self.steps()

    def _positions(self, lv: _Level, seg: Any, counts: np.ndarray) -> np.ndarray:
        """Batches each rank of ``lv`` took per bucket, by per-rank positions: (buckets, dp)."""
        nb, sched = lv.tab.size, lv.schedule.astype(np.int64)
        out = np.zeros((nb, lv.dp), np.int64)
        for d in range(lv.dp):
            starts = Bins([bb.cuts[d] if self.shard else bb.offsets for bb in lv.batches])
            step_of, _ = rank_batches(counts[:, d], [], sched, lv.window, 1, starts)
            pos = int(seg.positions[d])
            if pos > step_of.size:
                raise self.past_end(d, pos, step_of.size)
            reach = int(step_of[pos - 1]) + 1 if pos else 0
            out[:, d] = np.bincount(sched[:reach], minlength=nb)
        return out

    def _next_strata(self, b: int, bb: BucketBatches, taken: np.ndarray, dp: int,
                     cost: Any) -> tuple[BucketBatches, _Runs] | None:
        """What ranks of the top level left of its bucket ``b`` (which they took ``taken``
        batches of, per rank), as the next level's list (runs of the top level's codes, in
        cost order) and its batches."""
        lv, levels, base = self.top, self.levels, self.base
        counts = np.asarray([bb.count(d) for d in range(lv.dp)], np.int64)
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
        runs = _Runs(starts, lengths, bb.n, bb.passes)
        j0 = int(lv.tab[b])
        di, key = base.bucket_table[j0]
        order0 = base.buckets.order.orders[j0]
        n0 = base.buckets.order.batches[j0].n

        def sorted_cost(pos: np.ndarray) -> np.ndarray:
            code = _resolve(levels, b, runs.prev(np.asarray(pos, np.int64)))
            return np.asarray(cost[np.asarray(order0[code % n0], np.int64)], np.float64)
        made = BucketBatches(runs.total, 1, dp, sorted_cost,
                             derive_seed(self.seed, self.epoch, base.datasets[di], key, "budget", len(levels)),
                             self.budget, self.pol, True, base.pad_to is PadTo.BATCH, self.accumulation_steps)
        return (made, runs) if made.batches else None

    def rank(self, d: int, table: Sequence[tuple[int, Hashable]]) -> tuple[Any, ...]:
        """(entries per bucket, steps per bucket, where its batches start, the entry order,
        the shard-local order or None, BucketStats) of dp_rank ``d`` of the top level."""
        top, base, shard = self.top, self.base, self.shard
        counts = np.asarray([bb.count(d) for bb in top.batches], np.int64)
        bins = Bins([bb.cuts[d] if shard else bb.offsets for bb in top.batches])
        if shard:
            order: Any = ExplicitRemainder(top, d, self.shard_map())
            local = order
            real = [sum(int((~p).sum()) for p in bb.pad) for bb in top.batches]
            planned = [sum(int(p.size) for p in bb.pad) for bb in top.batches]
        else:
            j0 = top.tab.tolist()
            order = BudgetBuckets(top.batches, [base.buckets.order.orders[j] for j in j0], d,
                                  [base.buckets.order.n[j] for j in j0], partial(_resolve, self.levels))
            local = None
            real, planned = [bb.real for bb in top.batches], [bb.planned for bb in top.batches]
        steps = self.steps()
        return counts, steps, bins, order, local, self.stats(table, real, planned, steps, [False] * len(steps))

    def digest(self, segments: Sequence[Any], table: Sequence[tuple[int, Hashable]]) -> str:
        top = self.top
        doc = {"kind": "wds_pad.budget_remainder/1",
               "segments": self.segment_keys(segments),
               "dp": top.dp, "table": [[int(di), repr(key)] for di, key in table],
               "steps": [int(bb.batches) for bb in top.batches],
               "schedule": np.asarray(top.schedule, np.int64).tolist()}
        return json_digest(doc, size=16)


class _Runs:
    """A level's list of a bucket's entries in cost order, as runs of the previous level's.

    From level 0 (whose entries are codes ``pass * n + position``, a pass's positions in
    cost order): elementary runs of positions, each with the passes that remain at every
    position of it, listed position after position and, at one position, pass after pass
    (exactly cost order: what a stratum's weight, its last member's cost, needs). From a
    deeper level (one pass): runs of its list indices, which are disjoint.
    """

    def __init__(self, codes: np.ndarray, lengths: np.ndarray, n: int, passes: int) -> None:
        if passes == 1:
            order = np.argsort(codes, kind="stable")
            self.first, self.mult = codes[order], np.ones(order.size, np.int64)
            self.length = lengths[order]
            self.passes = np.zeros((order.size, 1), np.int64)
        else:
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
            self.first, self.length = lo, hi - lo
            self.mult = cover.sum(axis=1).astype(np.int64)
            # the passes present in each run, in order, padded with -1
            self.passes = np.where(cover, np.arange(passes)[None, :], passes)
            self.passes.sort(axis=1)
        self.n = n
        sizes = self.length * self.mult
        self.start = np.zeros(sizes.size, np.int64)
        np.cumsum(sizes[:-1], out=self.start[1:])
        self.total = int(sizes.sum())

    def prev(self, idx: np.ndarray) -> np.ndarray:
        """The previous level's codes (level 0) or list indices of entries ``idx``."""
        q = np.searchsorted(self.start, idx, side="right") - 1
        off = idx - self.start[q]
        m = self.mult[q]
        return self.passes[q, off % m] * self.n + self.first[q] + off // m


def _resolve(levels: list[_Level], j: int, idx: np.ndarray) -> np.ndarray:
    """Level-0 codes (``pass * n + cost position``) of entries ``idx`` of bucket ``j`` of
    ``levels[-1]``'s list (locality none)."""
    for at in range(len(levels) - 1, 0, -1):
        lv = levels[at]
        idx = lv.runs[j].prev(np.asarray(idx, np.int64))
        j = int(np.flatnonzero(levels[at - 1].tab == lv.tab[j])[0])
    return idx


class ExplicitRemainder(PlannedShardUses):
    """The top level's entries of this rank (locality shard), and the shards it reads."""

    def __init__(self, top: _Level, d: int, shard_map: Sequence[Any]) -> None:
        super().__init__(shard_map)
        self.top, self.d = top, d

    def entries(self, b: np.ndarray, k: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        b, k = np.asarray(b, np.int64), np.asarray(k, np.int64)
        samples, pad = np.empty(k.size, np.int64), np.empty(k.size, bool)
        for j in np.unique(b).tolist():
            sel = np.flatnonzero(b == j)
            cut: RankCuts = self.top.batches[j]
            samples[sel] = cut.ids[self.d][k[sel]]
            pad[sel] = cut.pad[self.d][k[sel]]
        return samples, pad


def _next_shard(cut: RankCuts, taken: np.ndarray, dp: int, cost: Any, budget: Budget, accumulation_steps: int,
                pol: str) -> tuple[RankCuts, None] | None:
    """What the ranks of a shard-local level left of a bucket, rank after rank, dealt to
    ``dp`` new ranks in contiguous blocks (padded cyclically unless ``none``) and cut again."""
    rest = [cut.ids[d][cut.cuts[d][min(int(taken[d]), cut.steps)]:][~cut.pad[d][cut.cuts[d][min(int(taken[d]), cut.steps)]:]]
            for d in range(len(cut.ids))]
    real = np.concatenate(rest) if rest else np.zeros(0, np.int64)
    n = int(real.size)
    if not n:
        return None
    unit = dp * accumulation_steps
    length = n if pol == "none" else -(-n // unit) * unit
    idx = np.arange(length, dtype=np.int64)
    ids, pad = real[idx % n], idx >= n
    bounds = np.arange(dp + 1, dtype=np.int64) * length // dp
    per_ids = [ids[bounds[d]:bounds[d + 1]] for d in range(dp)]
    per_pad = [pad[bounds[d]:bounds[d + 1]] for d in range(dp)]
    r = max(int(x.size) for x in per_ids)
    costs = np.zeros((dp, max(r, 1)), np.float64)
    for d in range(dp):
        costs[d, :per_ids[d].size] = np.asarray(cost[per_ids[d]], np.float64)
    counts = np.asarray([x.size for x in per_ids], np.int64)
    steps, cuts = lockstep_cuts(costs, counts, budget, accumulation_steps=accumulation_steps)
    if not steps:
        return None
    return RankCuts(per_ids, per_pad, steps, cuts), None
