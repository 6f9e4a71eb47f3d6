"""Planning an epoch of packed batches (core/budgets/packing.py's :class:`~wds_pad.core.budgets.packing.Pack`).

A Pack is planned as the budget of one pack (``seq_len``) with every bucket's pack count
a multiple of ``packs`` x ``accumulation_steps`` (core/budgets/budgetplan.py: strata, one sample
per DP rank, packed by best fit decreasing over the seeded order), then grouped: B
consecutive packs of a bucket are one batch. The schedule of the packs (B x K at a time,
core/planning/schedule.py) taken every B-th step is the schedule of the batches (K at a time), so
the grouped plan and the budget plan are the same epoch counted in different steps: the
elastic remainder of a packed epoch is the budget remainder of its packs
(core/elastic/remainder.py, with every segment's steps counted in packs), grouped again.

Invariants (tests/core/test_packplan.py):
- every rank's batch is ``packs`` packs, each of cost <= ``seq_len`` and at most
  ``max_segments`` samples (but for a sample costlier than ``seq_len`` with
  ``oversize="alone"``, alone in its pack); a costlier sample is otherwise refused;
- every DP rank has the same number of batches, a multiple of ``accumulation_steps``,
  all take the same bucket at a step, CP peers get identical batches;
- over the DP ranks an epoch holds every entry exactly once plus copies marked padded;
  a remainder what the earlier layouts left, exactly once;
- pure; the same inputs give the same packs anywhere.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Sequence

import numpy as np

from ...errors import ConfigError
from ..planning.buckettable import Planning, SizedBuckets
from ..dataset import Dataset
from .packing import Pack
from ..planning.planrecord import Bins, Plan, rank_batches
from ..policy import Policy

__all__ = ["PackCut", "PackNumbers", "group_plan"]


class PackNumbers:
    """Which pack of its batch each entry is in: batch w of kept bucket b is packs
    ``w * B .. w * B + B - 1`` of the bucket's pack starts on this rank."""

    def __init__(self, starts: Sequence[np.ndarray], packs: int) -> None:
        self.bins, self.packs = Bins(starts), int(packs)

    def numbers(self, b: np.ndarray, w: np.ndarray, sizes: np.ndarray) -> np.ndarray:
        """Pack numbers (0 .. B - 1) of the entries of batches (windows ``w`` of buckets ``b``,
        ``sizes`` entries each), batch after batch."""
        b = np.asarray(b, np.int64)[:, None]
        w = np.asarray(w, np.int64)[:, None] * self.packs + np.arange(self.packs + 1, dtype=np.int64)[None, :]
        edges = self.bins.start(b, w)
        per = np.diff(edges - edges[:, :1], axis=1)
        per = np.minimum(per, np.maximum(np.asarray(sizes, np.int64)[:, None] - (edges[:, :-1] - edges[:, :1]), 0))
        return np.repeat(np.tile(np.arange(self.packs, dtype=np.int64), b.shape[0]), per.ravel())


class PackCut:
    """The bucket cut of a :class:`~wds_pad.core.budgets.packing.Pack` (see the module docstring):
    the cut ``budget_cut`` makes of the budget of one pack with ``accumulation_steps`` x B
    (core/budgets/budgetplan.py's, handed over where both are registered, core/planning/plan.py),
    every B of a bucket's packs then one batch.

    Raises:
        ConfigError: policy ``none``; a sample costlier than ``seq_len`` (unless
            ``oversize="alone"``), with their count and the fix.
    """

    def __init__(self, budget_cut: Callable[..., Any], pack: Pack, at: Planning, dss: Sequence[Dataset]) -> None:
        if at.policy is Policy.NONE:
            raise ConfigError(f"{pack.describe()} with padding policy 'none': every rank's batch must be "
                              f"{pack.packs} packs; use pad='cyclic' or 'drop'")
        if pack.oversize == "refuse":
            _refuse_oversize(dss, pack)
        self.packs = pack.packs
        self.packed = budget_cut(pack.budget(), replace(at, accumulation_steps=at.accumulation_steps * pack.packs), dss)
        self.unit, self.batch, self.size, self.measure = (self.packed.unit, self.packed.batch, self.packed.size,
                                                          self.packed.measure)

    def cut(self, dss: Sequence[Dataset], got: Any, local: Any) -> SizedBuckets:
        sized, B = self.packed.cut(dss, got, local), self.packs
        starts = [np.asarray(s, np.int64) for s in (sized.starts or [])]
        return replace(sized, steps=[int(s) // B for s in sized.steps], starts=[s[::B] for s in starts],
                       packs=PackNumbers(starts, B))


def _refuse_oversize(dss: Sequence[Dataset], pack: Pack) -> None:
    """A ConfigError counting the samples costlier than ``seq_len``: O(log n) per bucket on
    its cost order."""
    over, worst, names = 0, 0.0, []
    for ds in dss:
        for key, ids in ds.buckets.items():
            n = len(ids)
            if not n:
                continue
            order = ds.sorted_by_cost(key)
            top = float(ds.cost[int(order[n - 1])])
            if top <= pack.seq_len:
                continue
            lo, hi = 0, n - 1  # the first position of the cost order past seq_len
            while lo < hi:
                mid = (lo + hi) // 2
                if float(ds.cost[int(order[mid])]) > pack.seq_len:
                    hi = mid
                else:
                    lo = mid + 1
            over += n - lo
            worst = max(worst, top)
            names.append(f"{ds.name}/{key!r}")
    if over:
        raise ConfigError(
            f"{over} sample(s) cost more than seq_len {pack.seq_len} (the costliest {worst:g}, in "
            f"{', '.join(names[:5])}{' ...' if len(names) > 5 else ''}): no pack can hold them. Raise seq_len, "
            "leave them out of the index, or let each travel alone in a pack of its own with "
            "Pack(..., oversize='alone') (wds-pad plan --oversize alone)")


def group_plan(plan: Plan, pack: Pack, accumulation_steps: int) -> Plan:
    """A plan of packs (a budget plan of ``seq_len`` whose buckets' pack counts are multiples
    of B x K) as a plan of batches of B packs each."""
    B = pack.packs
    nb = len(plan.bucket_table)
    steps = np.bincount(plan.schedule.astype(np.int64), minlength=nb)
    bins = plan.bins
    assert bins is not None
    pack_starts = [bins.flat[bins.base[b]: bins.base[b] + steps[b] + 1] for b in range(nb)]
    grouped = Bins([s[::B] for s in pack_starts])
    schedule, window = plan.schedule[::B], plan.window[::B] // B
    counts = plan.buckets.counts
    batch_step, offsets = rank_batches(counts, (steps // B).tolist(), schedule, window, 1, grouped)
    widest = int(np.diff(offsets).max(initial=1)) if offsets.size > 1 else 1
    stats = tuple(replace(s, steps=s.steps // B) for s in plan.stats)
    out = replace(plan, schedule=schedule, window=window, batch_step=batch_step, offsets=offsets, stats=stats,
                  sizing=pack, bins=grouped, accumulation_steps=accumulation_steps, batch_size=max(1, widest),
                  packs=PackNumbers(pack_starts, B))
    src = plan.buckets.local
    if src is not None and getattr(src, "plan", None) is plan:
        src.plan = out  # a shard-local remainder reads its shard uses off its own plan
    return out
