"""The levels of an elastic remainder (core/elastic/remainder.py) whose lists are runs of
the previous level's: a :class:`~wds_pad.core.sizing.Count`'s under every locality, and a
Budget's under shard or node locality.

Level 0 is the epoch planned on the first layout (``plan_epoch``); bucket b holds
``real_b`` entries that are samples of the epoch (positions ``[0, min(m_b, padded_b))``
of its global order; padded copies are not samples trained). Level j + 1 is what level
j's ranks left: per bucket, the remaining real entries of each rank of level j, rank
after rank, each in that rank's order (a run of level-j indices with a stride), padded
cyclically (copies from the list's own front, marked padded; ``none``: not padded) to a
multiple of the sizing's pad unit. Locality ``none`` in lockstep keeps it one run per
bucket (the consumed part is a prefix of the bucket's order). So a level costs
O(buckets x dp_size) to describe and an entry O(levels x log) to resolve.

How a level is dealt to its ranks (``deal``):
- ``rr`` (level 0, and locality ``none``): rank d takes level indices d + k * dp_size, as
  ``plan_epoch`` does, so each global step is one contiguous window of the order;
- ``block`` (locality ``shard`` after a resume): rank d takes the contiguous block
  ``[d * L // dp_size, (d + 1) * L // dp_size)``. The remainder lists each old rank's
  remaining entries together (its own shards, first in first out), so a new rank reads
  the remaining samples of a few old ranks' shards, about one GET per shard still needed.

How a rank's entries are cut into batches, the only part the sizing decides (``cut``):
- :class:`ListLevels` (a count): ``batch_size`` entries a batch, nothing stored; nothing
  materialises the epoch;
- :class:`LockstepLevels` (a budget, shard-local): every rank's entries cut in order into
  the same number of batches within the budget (core/budgets/budgetplan.py's
  ``shard_cut``, as a shard-local plan cuts them); to agree on that number every rank reads the cost of every entry of
  the level: O(its entries), like the shard-local plan it resumes.

Invariants (tests/core/test_remainder.py, test_budgetremainder.py): those of
core/elastic/remainder.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Hashable, Sequence

import numpy as np

from ..budgets.budgetplan import lockstep_unit, shard_cut
from ..local.shardschedule import PlannedShardUses
from ..planning.planrecord import Bins, Plan
from ..policy import padded_length, rank_position, rank_share
from .levels import Levels, Runs

__all__ = ["ListLevels", "LockstepLevels", "RemainderBuckets"]

RR, BLOCK = "rr", "block"


@dataclass(eq=False)
class _Level:
    tab: np.ndarray      # base kept-bucket index of each of its buckets (ascending)
    real: np.ndarray     # real entries per bucket
    length: np.ndarray   # padded length per bucket
    dp: int
    deal: str
    schedule: np.ndarray
    window: np.ndarray
    up: np.ndarray | None = None      # each bucket's position in the previous level
    off: np.ndarray | None = None     # first list index (over every bucket) of each bucket
    runs: Runs | None = None          # the list (over every bucket) as runs of the previous level's
    steps: list[int] = field(default_factory=list)  # per bucket, as its cut makes them
    cuts: list[np.ndarray] = field(default_factory=list)  # LockstepLevels: per bucket (dp, steps + 1) offsets
    ids: list[np.ndarray] = field(default_factory=list)   # LockstepLevels: per bucket, each entry's sample id

    def counts(self, d: np.ndarray) -> np.ndarray:
        """Entries (padded copies included) of ranks ``d`` per bucket: shape (buckets, len(d))."""
        n, dd = self.length[:, None], d[None, :]
        if self.deal == RR:
            return rank_share(n, self.dp, dd)
        return (dd + 1) * n // self.dp - dd * n // self.dp

    def reals(self, d: np.ndarray) -> np.ndarray:
        """Real entries of ranks ``d`` per bucket (shape (buckets, len(d))); they come first."""
        r, dd = self.real[:, None], d[None, :]
        if self.deal == RR:
            return rank_share(r, self.dp, dd)
        return np.clip(r - dd * self.length[:, None] // self.dp, 0, self.counts(d))

    def index(self, b: np.ndarray, d: Any, k: np.ndarray) -> np.ndarray:
        """Level index of entry k of rank d in bucket b."""
        if self.deal == RR:
            return rank_position(d, k, self.dp)
        return d * self.length[b] // self.dp + k


class ListLevels(Levels):
    """The levels of a count's remainder, listed as runs (see the module docstring), from the
    base plan on: a rank's batches hold ``batch_size`` of its entries each (a bucket's last
    may be short). :class:`LockstepLevels` changes only that cut."""

    def __init__(self, base: Plan, dss: Sequence[Any], sizing: Any, accumulation_steps: int, seed: int,
                 epoch: int, dp: int) -> None:
        super().__init__(base, dss, sizing, accumulation_steps, seed, epoch)
        self.bs = int(base.batch_size)
        length0 = np.asarray([s.padded_length for s in self.stats0], np.int64)
        real0 = np.minimum(np.asarray([s.length for s in self.stats0], np.int64), length0)
        self.levels = [_Level(tab=np.arange(len(self.stats0), dtype=np.int64), real=real0, length=length0,
                              dp=dp, deal=RR, schedule=base.schedule, window=base.window)]
        self.deal = BLOCK if base.locality.dealt else RR
        self.cut(self.top)

    # -- the cut: what the sizing decides --------------------------------------------------
    def cut(self, lv: _Level) -> None:
        """Cut the ranks' entries of level ``lv`` (the top one) into batches: batch w of a rank
        is its entries [w * batch_size, (w + 1) * batch_size), nothing stored but the steps."""
        lv.steps = self.sizing.steps(lv.length, lv.dp).tolist()

    def have(self, lv: _Level, counts: np.ndarray) -> np.ndarray:
        """Batches of each rank per bucket, which hold ``counts`` entries: (buckets, dp)."""
        return -(-counts // self.bs)

    def consumed(self, lv: _Level, took: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """Entries of each rank per bucket in the ``took`` batches it took: (buckets, dp)."""
        return np.minimum(took * self.bs, counts)

    def bins(self, lv: _Level, d: int) -> Bins | None:
        return None

    def oversubscribed(self, lv: _Level) -> np.ndarray:
        """Per bucket: padded up to one whole pad unit from fewer entries (the fresh plan's
        rule, ``buckettable.padded``: the unit of :meth:`unit`, accumulation steps included)."""
        return (lv.length > lv.real) & (lv.real < self.unit(lv.dp))

    # -- the walk ------------------------------------------------------------------------
    def advance(self, seg: Any, dp: int) -> tuple[np.ndarray, list[int]]:
        """Add the level ``seg`` left of the top one, dealt to ``dp`` ranks: (its buckets as base
        kept-bucket indices, steps per bucket)."""
        lv = self.top
        unit = self.unit(dp)
        nb = lv.tab.size
        if seg.steps is not None and self.deal == RR and lv.deal == RR:
            # locality none (a count: only it deals round robin) in lockstep: the consumed part of
            # each bucket is a prefix (its first taken * dp * bs positions): O(buckets), not O(buckets x dp)
            first = np.minimum(self.took(seg)[:, 0] * (lv.dp * self.bs), lv.real)
            bucket = np.arange(nb, dtype=np.int64)
            start, size = first, lv.real - first
            stride = np.ones(nb, np.int64)
        else:
            ranks = np.arange(lv.dp, dtype=np.int64)
            counts = lv.counts(ranks)
            e = self.consumed(lv, self.took(seg, lambda: self.have(lv, counts)), counts)
            reals = lv.reals(ranks)
            size = np.maximum(reals - e, 0).ravel()
            bucket = np.repeat(np.arange(nb, dtype=np.int64), lv.dp)
            start = lv.index(bucket, np.tile(ranks, nb), np.minimum(e, reals).ravel())
            stride = np.full(size.size, lv.dp if lv.deal == RR else 1, np.int64)
        keep = size > 0
        bucket, start, size, stride = bucket[keep], start[keep], size[keep], stride[keep]
        real = np.bincount(bucket, weights=size, minlength=nb).astype(np.int64)
        kept = np.flatnonzero(real > 0)
        real = real[kept]
        length = np.asarray([padded_length(r, unit, self.policy, True) for r in real.tolist()], np.int64)
        off = np.zeros(kept.size, np.int64)
        np.cumsum(real[:-1], out=off[1:])
        self.levels.append(_Level(tab=lv.tab[kept], real=real, length=length, dp=dp, deal=self.deal,
                                  schedule=np.zeros(0, np.int64), window=np.zeros(0, np.int64),
                                  up=kept.astype(np.int64), off=off, runs=Runs(size, start, stride)))
        self.cut(self.top)
        return self.top.tab, self.top.steps

    def rank(self, d: int, table: Sequence[tuple[int, Hashable]]) -> tuple[Any, ...]:
        """(entries per bucket, steps per bucket, where its batches start or None, the entry
        order, the shard-local order, BucketStats) of dp_rank ``d`` of the top level."""
        top = self.top
        counts = top.counts(np.asarray([d], np.int64))[:, 0]
        steps = top.steps
        rest = RemainderBuckets(self.levels, self.base.buckets, d,
                                self.shard_map() if self.base.locality.dealt else None)
        return (counts, steps, self.bins(top, d), rest, rest,
                self.stats(table, top.real, top.length, steps, self.oversubscribed(top)))


class LockstepLevels(ListLevels):
    """The levels of a budget's shard-local remainder: listed as a count's, each rank's
    entries cut in order into the same number of batches within the budget (per bucket,
    (dp, steps + 1) offsets)."""

    def unit(self, dp: int) -> int:
        return lockstep_unit(self.sizing, dp, self.accumulation_steps)

    def cut(self, lv: _Level) -> None:
        """Every bucket's cuts, from the costs of every rank's entries (each entry's sample id
        kept, in list order, for the next level's)."""
        ranks = np.arange(lv.dp, dtype=np.int64)
        counts = lv.counts(ranks)
        lv.cuts, lv.ids = [], []
        for b in range(lv.tab.size):
            idx = np.arange(int(lv.length[b]), dtype=np.int64)
            if lv.runs is None:  # level 0: the base plan's order
                lv.ids.append(self.base.buckets.at(np.full(idx.size, b, np.int64), idx)[0])
            else:  # padded copies repeat the list's own front
                prev = lv.runs.prev(lv.off[b] + idx % lv.real[b])  # type: ignore[index]
                lv.ids.append(self.levels[-2].ids[int(lv.up[b])][prev])  # type: ignore[index]
            cost = self.dss[self.base.bucket_table[int(lv.tab[b])][0]].cost
            lv.cuts.append(shard_cut(lambda d, k, b=b: lv.ids[b][lv.index(b, d, k)], counts[b], cost, self.sizing,
                                     self.accumulation_steps)[1])
        lv.steps = [int(c.shape[1]) - 1 for c in lv.cuts]

    def have(self, lv: _Level, counts: np.ndarray) -> np.ndarray:
        return np.asarray([(c[:, :-1] < counts[b][:, None]).sum(axis=1) for b, c in enumerate(lv.cuts)],
                          np.int64).reshape(-1, lv.dp)

    def consumed(self, lv: _Level, took: np.ndarray, counts: np.ndarray) -> np.ndarray:
        ranks = np.arange(lv.dp)
        return np.asarray([c[ranks, np.minimum(t, c.shape[1] - 1)] for c, t in zip(lv.cuts, took)],
                          np.int64).reshape(-1, lv.dp)

    def bins(self, lv: _Level, d: int) -> Bins | None:
        return Bins([c[d] for c in lv.cuts])

    def oversubscribed(self, lv: _Level) -> np.ndarray:
        return np.zeros(lv.tab.size, bool)


class RemainderBuckets(PlannedShardUses):
    """What a listed remainder's Plan computes its entries from (its ``EntryOrder``), and the
    shards it reads."""

    def __init__(self, levels: list[_Level], base: Any, d: int, shard_map: Any) -> None:
        super().__init__(shard_map)
        self.levels, self.base, self.d = levels, base, d

    def entries(self, b: np.ndarray, k: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        top = self.levels[-1]
        b = np.asarray(b, np.int64)
        return self.at(b, top.index(b, self.d, np.asarray(k, np.int64)))

    def at(self, b: np.ndarray, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(sample ids, padded flags) of the top level's indices ``idx`` of its buckets ``b``."""
        pad, _, b, idx = self.base_positions(b, idx)
        samples, _ = self.base.at(b, idx)
        return samples, pad

    def base_positions(self, b: np.ndarray, idx: np.ndarray) -> tuple[np.ndarray, ...]:
        """(padded flags, padding cycles, base buckets, base positions) of the top level's ``idx``."""
        top = self.levels[-1]
        pad = idx >= top.real[b]
        cycle = idx // np.maximum(top.real[b], 1)
        idx = idx % top.real[b]
        for lv in reversed(self.levels[1:]):
            idx = lv.runs.prev(lv.off[b] + idx)  # type: ignore[index, union-attr]
            b = lv.up[b]  # type: ignore[index]
        return pad, cycle, b, idx

    def copies(self, b: np.ndarray, k: np.ndarray) -> np.ndarray | None:
        """Copy numbers of entries ``k`` of buckets ``b``: the base order's (core/sampleseed.py),
        the padded copies of the remainder numbered after the base bucket's passes."""
        b = np.asarray(b, np.int64)
        idx = self.levels[-1].index(b, self.d, np.asarray(k, np.int64))
        if not idx.size or self.base.local is not None:
            return None
        _, cycle, bb, pos = self.base_positions(b, idx)
        copy = self.base.positions(bb, pos)
        passes = self.base.m[bb] // np.maximum(self.base.n[bb], 1)
        return copy + cycle * passes  # type: ignore[no-any-return]
