"""Planning an epoch under a budget: each bucket's batches sized by cost (core/budget.py).

``plan_epoch(..., batch_size=Budget(...))`` calls :func:`plan_buckets` for what differs
from a fixed batch size: which buckets are kept, how many steps each takes, which entries
a rank holds and where each of its batches starts. Everything after it (the schedule,
the rank's batches, the Plan record) is the fixed-size code.

- ``locality="none"``: each bucket's strata are packed into batches identically on every
  rank (:class:`~wds_pad.core.budget.BucketBatches`); a rank's entries are one member of
  each stratum, O(its share) to plan and O(1) each to evaluate.
- ``locality="shard"``: a rank's entries are those shard locality gives it (its own
  shards first in, first out, core/localbuckets.py), padded per bucket to a multiple of
  ``dp_size`` (x accumulation_steps) as ``cyclic`` / ``drop`` / ``none`` say; every rank
  cuts its entries, in order, into the same number of batches within the budget
  (:func:`~wds_pad.core.budget.lockstep_cuts`). To agree on that number every rank
  reads the cost of every entry of the dataset: O(samples), not O(share).

Invariants:
- every bucket takes the same number of steps on every rank, a multiple of
  ``accumulation_steps``; every rank's batch at a step is within the budget (but for a
  sample dearer than the budget, alone in its batch);
- over all DP ranks an epoch holds each entry (sample x pass) of a kept bucket exactly
  once, plus copies marked padded (``drop``: none repeated, some left out);
- pure: no I/O, no clock; bitwise the same plan in every process.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Hashable, Sequence

import numpy as np

from .budget import Budget
from .lockstep import lockstep_cuts
from .strata import BucketBatches
from .dataset import Dataset
from .localbuckets import LocalBuckets
from .planrecord import BucketStats
from .policy import Policy, check_bucket_size, check_planned_total, padded_length
from .seed import derive_seed

__all__ = ["BudgetBuckets", "BudgetedBuckets", "RankCuts", "plan_buckets", "shard_cut"]


class BudgetBuckets:
    """The kept buckets of a budgeted plan with ``locality="none"``: what ``Plan`` computes
    a rank's entries from (the ``budget`` hook of core/planrecord.py)."""

    def __init__(self, batches: Sequence[BucketBatches], orders: Sequence[Any], d: int) -> None:
        self.batches, self.orders, self.d = list(batches), list(orders), d

    def entries(self, b: np.ndarray, k: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(sample ids, padded flags) of this rank's entries ``k`` of kept buckets ``b``."""
        b = np.asarray(b, np.int64)
        k = np.asarray(k, np.int64)
        samples = np.empty(k.size, np.int64)
        pad = np.empty(k.size, bool)
        for j in np.unique(b).tolist():
            sel = np.flatnonzero(b == j)
            pos, _, copies = self.batches[j].at(np.full(sel.size, self.d, np.int64), k[sel])
            samples[sel] = np.asarray(self.orders[j][pos], dtype=np.int64)
            pad[sel] = copies
        return samples, pad


@dataclass(eq=False)
class RankCuts:
    """A bucket's entries on a shard-local layout: each rank's (sample ids, padded flags),
    in its order, and where each of its batches starts (the same count on every rank)."""

    ids: list[np.ndarray]
    pad: list[np.ndarray]
    steps: int
    cuts: np.ndarray  # (dp, steps + 1)

    @property
    def batches(self) -> int:
        return self.steps

    def count(self, d: int) -> int:
        return int(self.ids[d].size)


def shard_cut(local: LocalBuckets, j: int, length: int, real: int, dp: int, cost: Any, budget: Budget,
              accumulation: int) -> RankCuts:
    """Kept bucket ``j`` of a shard-local plan (``length`` entries padded, ``real`` of them
    samples): every rank's entries, and the lockstep cuts of them under ``budget``.
    O(the bucket's entries): every rank must know every rank's costs to agree on a count."""
    r = -(-length // dp)
    pos = np.arange(r * dp, dtype=np.int64)
    live = pos < length
    ids = np.zeros(r * dp, np.int64)
    ids[live], _ = local.at(np.full(int(live.sum()), j, np.int64), pos[live])
    costs = np.where(live, np.asarray(cost[ids], dtype=np.float64), 0.0)
    per_ids, per_cost = ids.reshape(r, dp).T, costs.reshape(r, dp).T  # rank d's entry k: position d + k * dp
    counts = np.maximum(0, -(-(length - np.arange(dp)) // dp))
    steps, cuts = lockstep_cuts(per_cost, counts, budget, multiple=accumulation)
    pad = (np.arange(dp)[:, None] + np.arange(r)[None, :] * dp) >= real
    return RankCuts([per_ids[d, :counts[d]] for d in range(dp)], [pad[d, :counts[d]] for d in range(dp)],
                    steps, cuts)


@dataclass
class BudgetedBuckets:
    """What :func:`plan_buckets` decides: the kept buckets and how a rank reads them."""

    table: list[tuple[int, Hashable]]
    stats: list[BucketStats]
    steps: list[int]          # global steps per kept bucket (a multiple of accumulation)
    counts: np.ndarray        # this rank's entries per kept bucket
    starts: list[np.ndarray]  # where each of this rank's batches starts, per kept bucket
    source: Any               # BudgetBuckets (none) or LocalBuckets (shard)
    dropped: list[str]
    dropped_samples: int


def _sorted_cost(ds: Dataset, order: Any) -> Any:
    cost = ds.cost

    def at(pos: np.ndarray) -> np.ndarray:
        return np.asarray(cost[np.asarray(order[pos], dtype=np.int64)], dtype=np.float64)
    return at


def plan_buckets(raw: Sequence[Any], dss: Sequence[Dataset], *, budget: Budget, policy: Policy,
                 oversubscribe: bool, top_up: bool, accumulation: int, seed: int, epoch: int,
                 dp: int, d: int, local: bool, window: int, group: int = 0) -> BudgetedBuckets:
    """Kept buckets, their steps and this rank's entries and batches under ``budget``.

    Args:
        raw, dss: the planned inputs and their Datasets (with costs).
        budget: the budget.
        policy: the resolved padding policy.
        oversubscribe: keep buckets with fewer entries than one per DP rank (cyclic).
        top_up: ``pad_to="batch"``: a bucket's last batch topped up with copies.
        accumulation: micro-batches per optimizer step (each bucket's steps a multiple).
        seed, epoch, dp, d: as for ``plan_epoch`` (``d`` this rank's dp_rank).
        local: ``locality="shard"`` or ``"node"``; ``window``: its window; ``group``: DP
            ranks per node for ``"node"`` (0: ``"shard"``).

    Raises:
        ConfigError: a dataset without costs (named).
    """
    for ds in dss:
        if ds.cost is None:
            ds.sorted_by_cost(next(iter(ds.buckets), None))  # raises the ConfigError naming it
    if local:
        return _shard_local(raw, dss, budget=budget, policy=policy, oversubscribe=oversubscribe,
                            accumulation=accumulation, seed=seed, epoch=epoch, dp=dp, d=d, window=window,
                            group=group)
    table: list[tuple[int, Hashable]] = []
    stats: list[BucketStats] = []
    batches: list[BucketBatches] = []
    orders: list[Any] = []
    dropped: list[str] = []
    dropped_samples = 0
    for di, ds in enumerate(dss):
        passes = 1 + ds.repeats
        for key, ids in ds.buckets.items():
            n = int(ids.size)
            if n == 0:
                stats.append(_stats(ds, key, 0, 0, 0, 0, False, False, 0))
                continue
            check_bucket_size(ds.name, key, n, passes, 0, dp, 1, dp, bool(oversubscribe))
            order = ds.sorted_by_cost(key)
            bb = BucketBatches(n, passes, dp, _sorted_cost(ds, order),
                               derive_seed(seed, epoch, ds.name, key, "budget"), budget, policy.value,
                               bool(oversubscribe), top_up, accumulation)
            kept = bb.batches > 0
            stats.append(_stats(ds, key, n, bb.planned, bb.real, bb.truncated, not kept,
                                kept and bb.complete == 0, bb.batches))
            if not kept:
                dropped.append(f"{ds.name}/{key!r} ({n * passes} < one entry per DP rank, {dp})")
                dropped_samples += n
                continue
            table.append((di, key))
            batches.append(bb)
            orders.append(order)
    check_planned_total(sum(st.padded_length for st in stats), epoch, f"budget {budget.limit:g}", dp)
    counts = np.asarray([bb.count(d) for bb in batches], np.int64)
    return BudgetedBuckets(table=table, stats=stats, steps=[bb.batches for bb in batches], counts=counts,
                           starts=[bb.offsets for bb in batches], source=BudgetBuckets(batches, orders, d),
                           dropped=dropped, dropped_samples=dropped_samples)


def _stats(ds: Dataset, key: Hashable, n: int, planned: int, real: int, truncated: int, dropped: bool,
           oversubscribed: bool, steps: int) -> BucketStats:
    m = n * (1 + ds.repeats)
    return BucketStats(dataset=ds.name, bucket=key, samples=n, repeats=ds.repeats, length=m,
                       padded_length=planned, padded_copies=max(planned - real, 0), truncated=truncated,
                       dropped=dropped, oversubscribed=oversubscribed, steps=steps)


def _shard_local(raw: Sequence[Any], dss: Sequence[Dataset], *, budget: Budget, policy: Policy,
                 oversubscribe: bool, accumulation: int, seed: int, epoch: int, dp: int, d: int,
                 window: int, group: int) -> BudgetedBuckets:
    unit = dp * accumulation
    table: list[tuple[int, Hashable]] = []
    stats: list[BucketStats] = []
    kept_local: list[tuple[int, Hashable, Any, int, int, int]] = []
    dropped: list[str] = []
    dropped_samples = 0
    for di, ds in enumerate(dss):
        passes = 1 + ds.repeats
        for key, ids in ds.buckets.items():
            n = int(ids.size)
            m = n * passes
            length = padded_length(m, unit, policy, bool(oversubscribe)) if n else 0
            check_bucket_size(ds.name, key, n, passes, length, dp, 1, unit, bool(oversubscribe))
            if n and not length:
                dropped.append(f"{ds.name}/{key!r} ({m} < pad unit {unit})")
                dropped_samples += n
            stats.append(_stats(ds, key, n, length, min(m, length), max(m - length, 0) if n else 0,
                                bool(n) and not length, bool(n) and 0 < m < unit <= length, 0))
            if length:
                table.append((di, key))
                kept_local.append((di, key, ids, n, passes, length))
    check_planned_total(sum(st.padded_length for st in stats), epoch, f"budget {budget.limit:g}", dp)
    local = LocalBuckets(raw, dss, kept_local, seed, epoch, dp, d, window, np.zeros(0, np.int64), 1, group)
    steps: list[int] = []
    starts: list[np.ndarray] = []
    counts = np.zeros(len(kept_local), np.int64)
    at = 0
    for j, (di, key, _ids, n, passes, length) in enumerate(kept_local):
        cut = shard_cut(local, j, length, min(n * passes, length), dp, dss[di].cost, budget, accumulation)
        steps.append(cut.steps)
        starts.append(cut.cuts[d])
        counts[j] = cut.count(d)
        while not (stats[at].dataset == dss[di].name and stats[at].bucket == key):
            at += 1
        stats[at] = BucketStats(**{**stats[at].__dict__, "steps": cut.steps})
    return BudgetedBuckets(table=table, stats=stats, steps=steps, counts=counts, starts=starts, source=local,
                           dropped=dropped, dropped_samples=dropped_samples)
