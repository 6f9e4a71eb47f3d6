"""The levels of an elastic remainder (core/elastic/remainder.py): what every sizing's share
(:class:`Levels`), and a :class:`~wds_pad.core.sizing.Count`'s: runs of positions.

Level 0 is the epoch planned on the first layout (``plan_epoch``); bucket b holds
``real_b`` entries that are samples of the epoch (positions ``[0, min(m_b, padded_b))``
of its global order; padded copies are not samples trained). Level j + 1 is what level
j's ranks left: per bucket, the remaining real entries of each rank of level j, rank
after rank, each in that rank's order (a run of level-j indices with a stride). Locality
``none`` in lockstep keeps it one run per bucket (the consumed part is a prefix of the
bucket's order). So a level costs O(buckets x dp_size) to describe and an entry
O(levels x log) to resolve: nothing materialises the epoch.

How a level is dealt to its ranks (``deal``):
- ``rr`` (level 0, and locality ``none``): rank d takes level indices d + k * dp_size, as
  ``plan_epoch`` does, so each global step is one contiguous window of the order;
- ``block`` (locality ``shard`` after a resume): rank d takes the contiguous block
  ``[d * L // dp_size, (d + 1) * L // dp_size)``. The remainder lists each old rank's
  remaining entries together (its own shards, first in first out), so a new rank reads
  the remaining samples of a few old ranks' shards, about one GET per shard still needed.

Invariants (tests/core/test_remainder.py): those of core/elastic/remainder.py; a remainder pads
each bucket cyclically (copies from its own front, marked padded) to a multiple of the
new pad unit (``none``: not padded).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Hashable, Sequence

import numpy as np

from ...errors import StateMismatchError
from ..planning.planrecord import BucketStats, Plan
from ..policy import Policy
from ..local.shardschedule import PlannedShardUses
from ..sizing import Count

__all__ = ["CountLevels"]

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
    off: np.ndarray | None = None     # first remainder index (over every bucket) of each bucket
    pstart: np.ndarray | None = None  # remainder index (over every bucket) where each run starts
    pfrom: np.ndarray | None = None   # previous-level index of each run's first entry
    pstride: np.ndarray | None = None

    def counts(self, d: np.ndarray) -> np.ndarray:
        """Entries (padded copies included) of ranks ``d`` per bucket: shape (buckets, len(d))."""
        n, dd = self.length[:, None], d[None, :]
        if self.deal == RR:
            return np.maximum(0, -(-(n - dd) // self.dp))
        return (dd + 1) * n // self.dp - dd * n // self.dp

    def reals(self, d: np.ndarray) -> np.ndarray:
        """Real entries of ranks ``d`` per bucket (shape (buckets, len(d))); they come first."""
        r, dd = self.real[:, None], d[None, :]
        if self.deal == RR:
            return np.maximum(0, -(-(r - dd) // self.dp))
        return np.clip(r - dd * self.length[:, None] // self.dp, 0, self.counts(d))

    def index(self, b: np.ndarray, d: Any, k: np.ndarray) -> np.ndarray:
        """Level index of entry k of rank d in bucket b."""
        if self.deal == RR:
            return d + self.dp * k
        return d * self.length[b] // self.dp + k


class Levels:
    """What the levels of every sizing share (a count's below, a budget's in
    core/elastic/budgetlevels.py): the base plan and its buckets' stats, the top level and
    its schedule, what a segment took of it, and the top level's stats."""

    def __init__(self, base: Plan, dss: Sequence[Any], sizing: Any, accumulation_steps: int, seed: int,
                 epoch: int) -> None:
        self.base, self.dss, self.sizing, self.seed, self.epoch = base, dss, sizing, seed, epoch
        self.accumulation_steps = accumulation_steps
        by_name = {(s.dataset, s.bucket): s for s in base.stats}
        self.stats0 = [by_name[(base.datasets[di], key)] for di, key in base.bucket_table]
        self.levels: list[Any] = []

    @property
    def top(self) -> Any:
        return self.levels[-1]

    def scheduled(self, schedule: np.ndarray, window: np.ndarray) -> None:
        self.top.schedule, self.top.window = schedule, window

    def taken(self, seg: Any) -> np.ndarray:
        """Steps of each bucket of the top level that a lockstep segment consumed.

        Raises:
            StateMismatchError: the segment goes past the level's last step.
        """
        lv = self.top
        if seg.steps > lv.schedule.size:
            raise StateMismatchError(
                f"loader state position {seg.steps} is past the end of epoch {self.epoch} on dp_size {lv.dp} "
                f"({lv.schedule.size} steps); the state does not belong to this plan")
        return np.bincount(lv.schedule[:seg.steps].astype(np.int64), minlength=lv.tab.size)

    def past_end(self, d: int, pos: int, batches: int) -> StateMismatchError:
        """The error of a per-rank segment whose dp_rank ``d`` took ``pos`` of its ``batches``."""
        return StateMismatchError(
            f"loader state position {pos} of dp_rank {d} is past the end of epoch {self.epoch} on dp_size "
            f"{self.top.dp} ({batches} batches on that rank); the state does not belong to this plan")

    @staticmethod
    def segment_keys(segments: Sequence[Any]) -> list[list[Any]]:
        """What a remainder's digest says of its segments: each one's layout and how far it got."""
        return [s.to_json()[:2] + ([s.node_ranks] if s.node_ranks else []) for s in segments]

    def shard_map(self) -> list[Any]:
        """Per dataset, each sample id's shard (the base plan's shard-local deal)."""
        return [dealt.layout.shard for dealt in self.base.buckets.local.dealt]

    def stats(self, table: Sequence[tuple[int, Hashable]], real: Any, planned: Any, steps: Any,
              oversubscribed: Any) -> tuple[BucketStats, ...]:
        """The top level's BucketStats: per bucket its ``real`` entries, ``planned`` with copies."""
        return tuple(
            BucketStats(dataset=self.base.datasets[di], bucket=key, samples=s0.samples, repeats=s0.repeats,
                        length=int(r), padded_length=int(n), padded_copies=int(n - r), truncated=0, dropped=False,
                        oversubscribed=bool(o), steps=int(st))
            for (di, key), s0, r, n, st, o in zip(table, [self.stats0[t] for t in self.top.tab.tolist()], real,
                                                   planned, steps, oversubscribed))


class CountLevels(Levels):
    """The levels of a count remainder (see the module docstring), from the base plan on."""

    def __init__(self, base: Plan, dss: Sequence[Any], sizing: Count, accumulation_steps: int, seed: int,
                 epoch: int, dp: int) -> None:
        super().__init__(base, dss, sizing, accumulation_steps, seed, epoch)
        self.bs = base.batch_size
        length0 = np.asarray([s.padded_length for s in self.stats0], np.int64)
        real0 = np.minimum(np.asarray([s.length for s in self.stats0], np.int64), length0)
        self.levels = [_Level(tab=np.arange(len(self.stats0), dtype=np.int64), real=real0, length=length0,
                              dp=dp, deal=RR, schedule=base.schedule, window=base.window)]
        self.deal = BLOCK if base.locality.dealt else RR

    def advance(self, seg: Any, dp: int) -> tuple[np.ndarray, list[int]]:
        """Add the level ``seg`` left of the top one, dealt to ``dp`` ranks: (its buckets as base
        kept-bucket indices, steps per bucket)."""
        lv, bs = self.top, self.bs
        unit = self.sizing.pad_unit(dp, self.base.pad_to, self.accumulation_steps)
        pad = self.base.policy is not Policy.NONE
        nb = lv.tab.size
        if seg.steps is not None and self.deal == RR and lv.deal == RR:
            # locality none in lockstep: the consumed part of each bucket is a prefix (its first
            # taken * dp * bs positions): O(buckets), not O(buckets x dp)
            first = np.minimum(self.taken(seg) * (lv.dp * bs), lv.real)
            bucket = np.arange(nb, dtype=np.int64)
            start, size = first, lv.real - first
            stride = np.ones(nb, np.int64)
        else:
            e = self._consumed(lv, seg)
            ranks = np.arange(lv.dp, dtype=np.int64)
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
        length = real if not pad else -(-real // unit) * unit
        off = np.zeros(kept.size, np.int64)
        np.cumsum(real[:-1], out=off[1:])
        pstart = np.zeros(size.size, np.int64)
        np.cumsum(size[:-1], out=pstart[1:])
        self.levels.append(_Level(tab=lv.tab[kept], real=real, length=length, dp=dp, deal=self.deal,
                                  schedule=np.zeros(0, np.int64), window=np.zeros(0, np.int64),
                                  up=kept.astype(np.int64), off=off, pstart=pstart, pfrom=start, pstride=stride))
        return self.top.tab, self.steps()

    def steps(self) -> list[int]:
        top = self.top
        return (-(-top.length // (top.dp * self.bs))).tolist()  # type: ignore[no-any-return]

    def _consumed(self, lv: _Level, seg: Any) -> np.ndarray:
        """Entries each rank of ``lv`` consumed per bucket (shape (buckets, dp))."""
        bs, nb = self.bs, lv.tab.size
        counts = lv.counts(np.arange(lv.dp, dtype=np.int64))
        if seg.steps is not None:
            return np.minimum(self.taken(seg)[:, None] * bs, counts)
        # per-rank positions: a rank lacks the batch of a bucket's window w when w * bs >= its
        # count; ranks differ only there (the optional steps), so each position maps to a step
        # in O(those steps), not by walking the rank's plan
        have = -(-counts // bs)
        lo, hi = have.min(axis=1), have.max(axis=1)
        sched = lv.schedule.astype(np.int64)
        win = lv.window.astype(np.int64)
        opt = np.flatnonzero((win >= lo[sched]) & (win < hi[sched])) if sched.size else np.zeros(0, np.int64)
        pos = np.asarray(seg.positions, dtype=np.int64)
        lacks = win[opt][:, None] >= have[sched[opt]]  # (optional steps, ranks): no batch there
        reach = pos.copy()  # the step after each rank's last consumed batch
        for o, row in zip(opt.tolist(), lacks):  # ascending: each lacking step before it pushes it on
            reach += row & (o < reach)
        total = sched.size - lacks.sum(axis=0)
        over = np.flatnonzero(pos > total)
        if over.size:
            raise self.past_end(int(over[0]), int(pos[over[0]]), int(total[over[0]]))
        took = np.zeros((nb, lv.dp), np.int64)
        order = np.argsort(sched, kind="stable")  # each bucket's steps, ascending
        bounds = np.searchsorted(sched[order], np.arange(nb + 1))
        for b in range(nb):
            took[b] = np.searchsorted(order[bounds[b]:bounds[b + 1]], reach)
        return np.minimum(took * bs, counts)

    def rank(self, d: int, table: Sequence[tuple[int, Hashable]]) -> tuple[Any, ...]:
        """(entries per bucket, steps per bucket, None: batches of ``batch_size``, the entry
        order, the shard-local order or None, BucketStats) of dp_rank ``d`` of the top level."""
        top, bs, base = self.top, self.bs, self.base
        counts = top.counts(np.asarray([d], np.int64))[:, 0]
        steps = self.steps()
        rest = RemainderBuckets(self.levels, base.buckets, d, self.shard_map() if base.locality.dealt else None)
        over = (top.length > top.real) & (top.real < base.pad_to.unit(top.dp, bs))
        return counts, steps, None, rest, rest, self.stats(table, top.real, top.length, steps, over)

    def digest(self, segments: Sequence[Any], table: Sequence[tuple[int, Hashable]]) -> str:
        top = self.top
        h = hashlib.blake2b(digest_size=16)
        h.update(repr(("wds_pad.remainder", 1, self.segment_keys(segments), top.dp, top.deal,
                       [(int(di), repr(key)) for di, key in table])).encode())
        for a in (top.real, top.length, top.schedule):
            h.update(np.ascontiguousarray(a, dtype=np.int64).tobytes())
        return h.hexdigest()


class RemainderBuckets(PlannedShardUses):
    """What a count remainder's Plan computes its entries from (its ``EntryOrder``), and the
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
        if not idx.size:
            return np.zeros(0, np.int64), np.zeros(0, bool)
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
            g = lv.off[b] + idx  # type: ignore[index]
            q = np.searchsorted(lv.pstart, g, side="right") - 1  # type: ignore[arg-type]
            idx = lv.pfrom[q] + lv.pstride[q] * (g - lv.pstart[q])  # type: ignore[index]
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
