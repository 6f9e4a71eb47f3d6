"""Planning an epoch under a budget: each bucket's batches sized by cost (core/budgets/budget.py).

:func:`budget_cut` is a budget's bucket cut (the protocol of core/planning/buckettable.py):
how a bucket is measured for the bucket table, how many steps each kept bucket takes,
which entries a rank holds and where each of its batches starts. The rest (the bucket
table, the entry order, the schedule, the Plan) is the one planner's (core/planning/plan.py).

- ``locality="none"``: each bucket's strata are packed into batches identically on every
  rank (:class:`~wds_pad.core.budgets.strata.BucketBatches`); a rank's entries are one member of
  each stratum, O(its share) to plan and O(1) each to evaluate.
- ``locality="shard"``: a rank's entries are those shard locality gives it (its own
  shards first in, first out, core/local/localbuckets.py), padded per bucket to a multiple of
  ``dp_size`` (x accumulation_steps) as ``cyclic`` / ``drop`` / ``none`` say; every rank
  cuts its entries, in order, into the same number of batches within the budget
  (:func:`lockstep_cuts`). To agree on that number every rank reads the cost of every
  entry of the dataset: O(samples), not O(share).

Invariants:
- every bucket takes the same number of steps on every rank, a multiple of
  ``accumulation_steps``; every rank's batch at a step is within the budget (but for a
  sample dearer than the budget, alone in its batch);
- with ``locality="shard"`` every rank's entries are cut in order, each batch a run of
  them, none empty while the rank has as many entries as batches;
- over all DP ranks an epoch holds each entry (sample x pass) of a kept bucket exactly
  once, plus copies marked padded (``drop``: none repeated, some left out);
- pure: no I/O, no clock; bitwise the same plan in every process.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Hashable, Sequence

import numpy as np

from ..planning.buckettable import BucketTable, Measured, Planning, SizedBuckets, padded
from .budget import Budget, BudgetModel
from ..dataset import Dataset
from ..policy import PadTo, rank_position, rank_share
from ..sampleseed import PADDED
from ..seed import derive_seed
from .strata import BucketBatches

__all__ = ["BudgetBuckets", "LockstepCut", "StrataCut", "budget_cut", "lockstep_cuts", "lockstep_unit", "shard_cut"]


class BudgetBuckets:
    """This rank's entries of kept buckets batched by strata (``locality="none"``), the
    ``EntryOrder`` of a plan or its elastic remainder: per bucket its ``batches``, and its
    base bucket's cost order and ``n`` samples; ``resolve(j, codes)`` turns bucket j's codes
    into its base bucket's (``pass * n + cost position``; default: they are)."""

    def __init__(self, batches: Sequence[BucketBatches], orders: Sequence[Any], d: int,
                 n: Sequence[int] | None = None, resolve: Any = None) -> None:
        self.batches, self.orders, self.d = list(batches), list(orders), d
        self.n = [bb.n for bb in self.batches] if n is None else list(n)
        self.resolve = resolve or (lambda j, code: code)

    def entries(self, b: np.ndarray, k: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return self.numbered(b, k)[:2]

    def numbered(self, b: np.ndarray, k: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(sample ids, padded flags, copy numbers) of entries ``k`` of kept buckets ``b``: a
        copy number is the entry's pass, plus ``PADDED`` for a padded copy (core/sampleseed.py)."""
        b, k = np.asarray(b, np.int64), np.asarray(k, np.int64)
        samples, pad, number = np.empty(k.size, np.int64), np.empty(k.size, bool), np.empty(k.size, np.int64)
        for j in np.unique(b).tolist():
            sel = np.flatnonzero(b == j)
            bb, n = self.batches[j], self.n[j]
            pos, passes, copies = bb.at(np.full(sel.size, self.d, np.int64), k[sel])
            code = self.resolve(j, passes * bb.n + pos)
            samples[sel] = np.asarray(self.orders[j][code % n], dtype=np.int64)
            pad[sel] = copies
            number[sel] = code // n + PADDED * copies
        return samples, pad, number


def lockstep_unit(budget: Budget, dp: int, accumulation_steps: int) -> int:
    """What a shard-local budget pads each bucket's list to: ``dp_size`` x ``accumulation_steps``
    entries, so each rank's entries come in whole optimizer steps (``Budget.pad_unit``, which
    the fingerprint records, is the strata's ``dp_size``)."""
    return budget.pad_unit(dp) * accumulation_steps


def shard_cut(ids: Callable[[np.ndarray, np.ndarray], np.ndarray], counts: np.ndarray, cost: Any, budget: Budget,
              accumulation_steps: int) -> tuple[int, np.ndarray]:
    """A shard-local bucket cut in lockstep under ``budget`` (:func:`lockstep_cuts`): rank d
    holds ``counts[d]`` entries, ``ids(d, k)`` are the sample ids of entries ``k`` of ranks
    ``d``. O(the bucket's entries): every rank must know every rank's costs to agree on a count."""
    counts = np.asarray(counts, np.int64)
    costs = np.zeros((counts.size, int(counts.max(initial=0))), np.float64)
    d, k = np.nonzero(np.arange(costs.shape[1], dtype=np.int64)[None, :] < counts[:, None])
    costs[d, k] = np.asarray(cost[ids(d, k)], np.float64)
    return lockstep_cuts(costs, counts, budget, accumulation_steps=accumulation_steps)


def lockstep_cuts(costs: np.ndarray, counts: np.ndarray, budget: Budget,
                  accumulation_steps: int = 1) -> tuple[int, np.ndarray]:
    """Cut every DP rank's own entry sequence of a bucket into the same number of batches,
    in order (``locality="shard"``: a rank's entries follow its shards' windows, so a
    batch is a run of them), each within ``budget``.

    Args:
        costs: (dp, r) costs of each rank's entries in its order (columns past
            ``counts[d]`` are ignored).
        counts: entries of each rank (equal but for policy ``none``).
        budget: the budget.
        accumulation_steps: the batch count is a multiple of this (gradient accumulation).

    Returns:
        (batches, cuts): the batch count S, the same for every rank, and (dp, S + 1) entry
        offsets: rank d's batch w is its entries ``cuts[d, w]:cuts[d, w + 1]``. Under
        ``sum`` a rank's batches are cut where its running cost passes each multiple of
        its total / S, and S is the least (rounded up to ``accumulation_steps``) that keeps every
        batch of every rank within the budget that way: ``ceil(max_d total_d / (limit -
        largest entry))``. Under ``max``, or where ``max_samples`` binds, batches hold
        equal counts (within one) of at most ``floor(limit / largest entry)`` entries.
        An entry dearer than the budget makes every batch one entry.
    """
    dp = costs.shape[0]
    counts = np.asarray(counts, np.int64)
    r = int(counts.max(initial=0))
    if r == 0:
        return 0, np.zeros((dp, 1), np.int64)
    live = np.arange(costs.shape[1])[None, :] < counts[:, None]
    c = np.where(live, costs, 0.0)
    top = float(c.max())
    cap = budget.max_samples or r
    per = max(1, min(cap, int(budget.limit // top))) if 0 < top <= budget.limit else (1 if top else cap)

    def rounded(s: int) -> int:
        return min(-(-max(s, 1) // accumulation_steps) * accumulation_steps, r)

    def even(s: int) -> tuple[int, np.ndarray]:
        w = np.arange(s + 1, dtype=np.int64)[None, :]
        return s, np.minimum(w * r // s, counts[:, None])

    if top > budget.limit or budget.model is BudgetModel.MAX:
        return even(rounded(-(-r // per)))
    totals = c.sum(axis=1)
    room = budget.limit - top  # what a batch may hold beyond its largest entry
    need = int(math.ceil(float(totals.max()) / room)) if room > 0 else r
    s = rounded(max(need, -(-r // cap)))
    cum = np.cumsum(c, axis=1)
    cuts = np.zeros((dp, s + 1), np.int64)
    for d in range(dp):
        n = int(counts[d])
        if n == 0:
            continue
        # entry j goes to batch floor(midpoint_j * S / total): a batch costs at most
        # total / S + the largest entry <= limit
        mid = cum[d, :n] - c[d, :n] / 2.0
        if totals[d] > 0:
            part = np.minimum((mid * (s / float(totals[d]))).astype(np.int64), s - 1)
        else:
            part = np.arange(n, dtype=np.int64) * s // n
        cuts[d, 1:] = np.searchsorted(part, np.arange(1, s + 1), side="left")
        cuts[d] = _non_empty(cuts[d], n)
        if int(np.diff(cuts[d]).max(initial=0)) > cap:  # the count bound binds: even counts
            return even(rounded(-(-r // per)))
    return s, cuts


def _non_empty(cut: np.ndarray, n: int) -> np.ndarray:
    """Offsets moved so that every batch holds an entry (while there are as many entries
    as batches): a batch either keeps a subset of its entries or takes a single one, so
    none gets dearer than the budget allowed."""
    s = cut.size - 1
    k = np.arange(s + 1, dtype=np.int64)
    up = np.maximum.accumulate(cut - k) + k          # strictly increasing from the front
    return np.minimum(up, np.maximum(n - (s - k), k.clip(max=n)))  # ... and room at the end


class StrataCut:
    """A budget's bucket cut over strata (``locality="none"``): each bucket measured and cut
    into batches by :class:`~wds_pad.core.budgets.strata.BucketBatches`, the same on every
    rank; this rank's entries are one member of each stratum (:class:`BudgetBuckets`)."""

    batch = 1

    def __init__(self, budget: Budget, at: Planning, dss: Sequence[Dataset]) -> None:
        self.budget, self.at, self.unit, self.size = budget, at, budget.pad_unit(at.dp), budget.describe()

    def measure(self, ds: Dataset, key: Hashable, ids: Any, n: int, passes: int) -> Measured:
        at, order = self.at, ds.sorted_by_cost(key)
        bb = BucketBatches(n, passes, at.dp,
                           lambda pos: np.asarray(ds.cost[np.asarray(order[pos], np.int64)], np.float64),
                           derive_seed(at.seed, at.epoch, ds.name, key, "budget"), self.budget, at.policy.value,
                           at.oversubscribe, at.pad_to is PadTo.BATCH, at.accumulation_steps)
        return Measured(length=bb.planned, real=bb.real, truncated=bb.truncated, steps=bb.batches,
                        oversubscribed=bb.batches > 0 and bb.complete == 0,
                        dropped_why=f"({n * passes} < one entry per DP rank, {at.dp})", cut=(bb, order))

    def cut(self, dss: Sequence[Dataset], got: BucketTable, local: Any) -> SizedBuckets:
        batches, d = [kb.cut[0] for kb in got.kept], self.at.d
        return SizedBuckets(got, steps=[bb.batches for bb in batches],
                            counts=np.asarray([bb.count(d) for bb in batches], np.int64),
                            starts=[bb.offsets for bb in batches],
                            order=BudgetBuckets(batches, [kb.cut[1] for kb in got.kept], d))


class LockstepCut:
    """A budget's bucket cut over a shard-local order: each bucket padded to
    :func:`lockstep_unit`, every rank's entries cut in order into the same number of
    batches (:func:`shard_cut`)."""

    batch = 1

    def __init__(self, budget: Budget, at: Planning, dss: Sequence[Dataset]) -> None:
        self.budget, self.at, self.size = budget, at, budget.describe()
        self.unit = lockstep_unit(budget, at.dp, at.accumulation_steps)
        self.measure = padded(self.unit, at.policy, at.oversubscribe, None)  # steps known once cut

    def cut(self, dss: Sequence[Dataset], got: BucketTable, local: Any) -> SizedBuckets:
        at, ranks = self.at, np.arange(self.at.dp, dtype=np.int64)
        counts = [rank_share(kb.length, at.dp, ranks) for kb in got.kept]
        cuts = [shard_cut(lambda d, k, j=j: local.at(np.full(d.size, j, np.int64), rank_position(d, k, at.dp))[0],
                          counts[j], dss[kb.di].cost, self.budget, at.accumulation_steps)
                for j, kb in enumerate(got.kept)]
        return SizedBuckets(got, steps=[s for s, _ in cuts], starts=[c[at.d] for _, c in cuts],
                            counts=np.asarray([c[at.d] for c in counts], np.int64), order=local, local=local)


def budget_cut(budget: Budget, at: Planning, dss: Sequence[Dataset]) -> StrataCut | LockstepCut:
    """The bucket cut of a :class:`~wds_pad.core.budgets.budget.Budget` (see the module
    docstring): strata in the keyed order, lockstep cuts in a shard-local one."""
    return (LockstepCut if at.locality.dealt else StrataCut)(budget, at, dss)
