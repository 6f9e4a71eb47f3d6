"""The remainder of an epoch: what is left of it after earlier DP layouts consumed a part.

An epoch resumed on another number of DP ranks is planned as what remains of it: every
entry of the epoch not yet trained on, exactly once, cyclically padded per bucket to the
new layout's pad unit, scheduled in lockstep on the new ranks. Pure (no I/O, no clock):
the same (datasets, seed, epoch, policy, segments, topology) give the same plan.

Levels. Level 0 is the epoch planned on the first layout (``plan_epoch``); bucket b holds
``real_b`` entries that are samples of the epoch (positions ``[0, min(m_b, padded_b))``
of its global order; padded copies are not samples trained). Segment j says how far the
ranks of level j's layout got (``steps`` in lockstep, or each DP rank's batch index with
policy ``none``); level j + 1 is what it left: per bucket, the remaining real entries of
each rank of level j, rank after rank, each in that rank's order (a run of level-j
indices with a stride). Locality ``none`` in lockstep keeps it one run per bucket (the
consumed part is a prefix of the bucket's order). So a level costs O(buckets x dp_size)
to describe and an entry O(levels x log) to resolve: nothing materialises the epoch.

How a level is dealt to its ranks (``deal``):
- ``rr`` (level 0, and locality ``none``): rank d takes level indices d + k * dp_size, as
  ``plan_epoch`` does, so each global step is one contiguous window of the order;
- ``block`` (locality ``shard`` after a resume): rank d takes the contiguous block
  ``[d * L // dp_size, (d + 1) * L // dp_size)``. The remainder lists each old rank's
  remaining entries together (its own shards, first in first out), so a new rank reads
  the remaining samples of a few old ranks' shards, about one GET per shard still needed.

Invariants (tests/core/test_remainder.py):
- the union over earlier segments of what their ranks consumed, plus the real entries
  of the remainder over every new rank, is the epoch's real entries, each exactly once;
- the remainder pads each bucket cyclically (copies from its own front, marked padded)
  to a multiple of the new pad unit, whatever the policy (``none``: not padded): drop
  would lose samples not yet trained. Every new rank gets the same batch count, all take
  the same bucket at the same step, and CP peers (same dp_rank) get identical batches;
- buckets left empty contribute nothing; the plan is bitwise identical on every rank.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Sequence

import numpy as np

from ..errors import ConfigError, StateError, StateMismatchError
from .budget import Budget
from .budgetremainder import plan_budget_remainder
from .dataset import as_datasets
from .locality import Locality
from .packplan import pack_remainder
from .plan import plan_epoch
from .planrecord import BucketStats, Plan, Buckets, rank_batches
from .shardschedule import PlannedShardUses
from .policy import PadTo, Policy, parse_enum
from .schedule import step_schedule
from .sizing import Count, as_sizing
from .topology import Topology

__all__ = ["Remainder", "Segment", "plan_remainder"]

RR, BLOCK = "rr", "block"


@dataclass(frozen=True)
class Segment:
    """How far the ranks of one earlier layout got in the epoch (or its remainder).

    Attributes:
        dp_size: DP ranks of that layout.
        steps: batches every rank took (lockstep policies), or None.
        positions: batches each DP rank took, indexed by dp_rank (policy ``none``), or None.
        fingerprint: the fingerprint of the remainder this segment left (as planned on the
            next layout), as saved; "" if not known. Not part of the remainder's digest.
        node_ranks: DP ranks per node of that layout (``locality="node"``: how its shards
            were dealt); 0 for the other localities.
    """

    dp_size: int
    steps: int | None = None
    positions: tuple[int, ...] | None = None
    fingerprint: str = ""
    node_ranks: int = 0

    def __post_init__(self) -> None:
        if (self.steps is None) == (self.positions is None):
            raise StateError("an elastic segment holds either steps or per-rank positions")
        if self.positions is not None and len(self.positions) != self.dp_size:
            raise StateError(f"an elastic segment on dp_size {self.dp_size} holds {len(self.positions)} "
                             "per-rank positions; it needs one per DP rank")

    def to_json(self) -> list[Any]:
        """``[dp_size, steps or [index per dp_rank]]``, plus the fingerprint when known, plus
        the DP ranks per node of a node-local layout."""
        out: list[Any] = [self.dp_size, self.steps if self.positions is None else list(self.positions)]
        if self.node_ranks:
            return out + [self.fingerprint, self.node_ranks]
        return out + [self.fingerprint] if self.fingerprint else out

    def topology(self) -> Topology:
        """Rank 0 of this segment's layout (as planned: its DP ranks, its nodes)."""
        return Topology(world_size=self.dp_size, rank=0, local_world_size=self.node_ranks or None)


@dataclass(frozen=True, eq=False)
class Remainder:
    """This rank's plan of what is left of an epoch, and its fingerprint (every rank's alike)."""

    plan: Plan
    fingerprint: str


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


def _taken(lv: _Level, seg: Segment, epoch: int) -> np.ndarray:
    """Steps of each bucket of ``lv`` that a lockstep segment consumed."""
    if seg.dp_size != lv.dp:
        raise StateError(f"an elastic segment says dp_size {seg.dp_size} where its layout had {lv.dp}")
    if seg.steps > lv.schedule.size:  # type: ignore[operator]
        raise StateMismatchError(
            f"loader state position {seg.steps} is past the end of epoch {epoch} on dp_size {lv.dp} "
            f"({lv.schedule.size} steps); the state does not belong to this plan")
    return np.bincount(lv.schedule[:seg.steps].astype(np.int64), minlength=lv.tab.size)


def _consumed(lv: _Level, seg: Segment, bs: int, epoch: int) -> np.ndarray:
    """Entries each rank of ``lv`` consumed per bucket (shape (buckets, dp))."""
    if seg.dp_size != lv.dp:
        raise StateError(f"an elastic segment says dp_size {seg.dp_size} where its layout had {lv.dp}")
    ranks = np.arange(lv.dp, dtype=np.int64)
    counts = lv.counts(ranks)
    nb = lv.tab.size
    if seg.steps is not None:
        return np.minimum(_taken(lv, seg, epoch)[:, None] * bs, counts)
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
        d = int(over[0])
        raise StateMismatchError(
            f"loader state position {int(pos[d])} of dp_rank {d} is past the end of epoch {epoch} on "
            f"dp_size {lv.dp} ({int(total[d])} batches on that rank); the state does not belong to this plan")
    taken = np.zeros((nb, lv.dp), np.int64)
    order = np.argsort(sched, kind="stable")  # each bucket's steps, ascending
    bounds = np.searchsorted(sched[order], np.arange(nb + 1))
    for b in range(nb):
        taken[b] = np.searchsorted(order[bounds[b]:bounds[b + 1]], reach)
    return np.minimum(taken * bs, counts)


def _next_level(lv: _Level, seg: Segment, epoch: int, one_run: bool, dp: int, deal: str, bs: int, unit: int,
                pad: bool) -> tuple[_Level, list[int]]:
    """The level left by ``lv`` after segment ``seg`` of its ranks."""
    nb = lv.tab.size
    if one_run:  # locality none in lockstep: the consumed part of each bucket is a prefix
        # (its first taken * dp * bs positions): O(buckets), not O(buckets x dp)
        first = np.minimum(_taken(lv, seg, epoch) * (lv.dp * bs), lv.real)
        bucket = np.arange(nb, dtype=np.int64)
        start, size = first, lv.real - first
        stride = np.ones(nb, np.int64)
    else:
        e = _consumed(lv, seg, bs, epoch)
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
    steps = (-(-length // (dp * bs))).tolist()
    nxt = _Level(tab=lv.tab[kept], real=real, length=length, dp=dp, deal=deal,
                 schedule=np.zeros(0, np.int64), window=np.zeros(0, np.int64), up=kept.astype(np.int64),
                 off=off, pstart=pstart, pfrom=start, pstride=stride)
    return nxt, steps


class _RemainderBuckets(PlannedShardUses):
    """What a remainder Plan computes its entries from (its ``EntryOrder``), and the shards it reads."""

    def __init__(self, levels: list[_Level], base: Any, d: int, shard_map: Any) -> None:
        self.levels, self.base, self.d = levels, base, d
        self._shard_map = shard_map  # per dataset: sample id -> shard (locality shard), or None
        self._uses: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self.plan: Plan | None = None

    def entries(self, b: np.ndarray, k: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        top = self.levels[-1]
        b = np.asarray(b, np.int64)
        return self.at(b, top.index(b, self.d, np.asarray(k, np.int64)))

    def at(self, b: np.ndarray, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(sample ids, padded flags) of the top level's indices ``idx`` of its buckets ``b``."""
        if not idx.size:
            return np.zeros(0, np.int64), np.zeros(0, bool)
        pad, _, b, idx = self._base_positions(b, idx)
        samples, _ = self.base.at(b, idx)
        return samples, pad

    def _base_positions(self, b: np.ndarray, idx: np.ndarray) -> tuple[np.ndarray, ...]:
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
        _, cycle, bb, pos = self._base_positions(b, idx)
        copy = self.base.positions(bb, pos)
        passes = self.base.m[bb] // np.maximum(self.base.n[bb], 1)
        return copy + cycle * passes  # type: ignore[no-any-return]


def _digest(segments: Sequence[Segment], top: _Level, table: Sequence[tuple[int, Hashable]]) -> str:
    h = hashlib.blake2b(digest_size=16)
    h.update(repr(("wds_pad.remainder", 1, [s.to_json()[:2] + ([s.node_ranks] if s.node_ranks else [])
                                            for s in segments], top.dp, top.deal,
                   [(int(di), repr(key)) for di, key in table])).encode())
    for a in (top.real, top.length, top.schedule):
        h.update(np.ascontiguousarray(a, dtype=np.int64).tobytes())
    return h.hexdigest()


def plan_remainder(datasets: Any, topology: Topology, segments: Sequence[Segment], *, seed: int, epoch: int,
                   batch_size: int | Count | Budget, policy: Policy | str, mode: Any = "epochs", oversubscribe: bool = False,
                   pad_to: PadTo | str = PadTo.BATCH, locality: Locality | str = Locality.NONE,
                   window: int = 8, accumulation_steps: int = 1, mix_by: str = "samples",
                   epoch_size: float | None = None) -> Remainder:
    """This rank's plan of what ``segments`` left of ``epoch`` (see the module docstring).

    Args:
        datasets, seed, epoch, batch_size, policy, mode, oversubscribe, pad_to, locality,
            window: as for ``plan_epoch`` (the same for every layout of the epoch).
        topology: this rank's (new) topology.
        segments: the earlier layouts in order, each with how far its ranks got; at least one.

    Raises:
        StateMismatchError: a segment goes past the end of what its layout had.
        StateError: a malformed segment.
    """
    if not segments:
        raise StateError("plan_remainder needs at least one segment")
    if any(ds.proportion is not None for ds in as_datasets(datasets)):
        raise ConfigError("an epoch planned with proportions resumes on the layout it was saved on: its elastic "
                          "remainder (another number of DP ranks) is not planned; restart with the saved topology")
    sizing = as_sizing(batch_size)
    plan, digest = REMAINDER_PLANNERS[sizing.kind](
        datasets, topology, segments, seed=seed, epoch=epoch, batch_size=sizing, policy=policy, mode=mode,
        oversubscribe=oversubscribe, pad_to=pad_to, locality=locality, window=window,
        accumulation_steps=accumulation_steps)
    return Remainder(plan, digest)


def _count_remainder(datasets: Any, topology: Topology, segments: Sequence[Segment], *, seed: int, epoch: int,
                     batch_size: Count, policy: Policy | str, mode: Any = "epochs", oversubscribe: bool = False,
                     pad_to: PadTo | str = PadTo.BATCH, locality: Locality | str = Locality.NONE,
                     window: int = 8, accumulation_steps: int = 1) -> tuple[Plan, str]:
    """The remainder of an epoch of batches of ``batch_size.batch_size`` samples, and its fingerprint."""
    locality = parse_enum(Locality, locality, "locality")
    pad_to = parse_enum(PadTo, pad_to, "pad_to")
    k = int(accumulation_steps)
    common = dict(seed=seed, epoch=epoch, batch_size=batch_size, policy=policy, mode=mode,
                  oversubscribe=oversubscribe, pad_to=pad_to, warn=False, locality=locality, window=window,
                  accumulation_steps=k)
    base = plan_epoch(datasets, segments[0].topology(), **common)  # type: ignore[arg-type]
    dss = as_datasets(datasets)
    bs, pol = base.batch_size, base.policy
    by_name = {(s.dataset, s.bucket): s for s in base.stats}
    stats0 = [by_name[(base.datasets[di], key)] for di, key in base.bucket_table]
    length0 = np.asarray([s.padded_length for s in stats0], np.int64)
    real0 = np.minimum(np.asarray([s.length for s in stats0], np.int64), length0)
    levels = [_Level(tab=np.arange(len(stats0), dtype=np.int64), real=real0, length=length0,
                     dp=segments[0].dp_size, deal=RR, schedule=base.schedule, window=base.window)]
    deal = BLOCK if locality.dealt else RR
    pad = pol is not Policy.NONE
    for j, seg in enumerate(segments):
        lv = levels[-1]
        dp = segments[j + 1].dp_size if j + 1 < len(segments) else int(topology.dp_size)  # type: ignore[arg-type]
        unit = batch_size.pad_unit(dp, pad_to, k)
        one_run = seg.steps is not None and deal == RR and lv.deal == RR
        nxt, steps = _next_level(lv, seg, epoch, one_run, dp, deal, bs, unit, pad)
        table = [base.bucket_table[int(t)] for t in nxt.tab]
        nxt.schedule, nxt.window = step_schedule(dss, table, steps, seed, epoch, group=k)
        levels.append(nxt)
    top = levels[-1]
    table = tuple(base.bucket_table[int(t)] for t in top.tab)
    d = int(topology.dp_rank)  # type: ignore[arg-type]
    counts = top.counts(np.asarray([d], np.int64))[:, 0]
    steps = (-(-top.length // (top.dp * bs))).tolist()
    batch_step, offsets = rank_batches(counts, steps, top.schedule, top.window, bs)
    shard_map = None
    if locality.dealt:
        shard_map = [dealt.layout.shard for dealt in base.buckets.local.dealt]  # type: ignore[union-attr]
    rest = _RemainderBuckets(levels, base.buckets, d, shard_map)
    buckets = Buckets([], top.dp, d, order=rest, local=rest, counts=counts)
    stats = tuple(
        BucketStats(dataset=base.datasets[di], bucket=key, samples=stats0[int(t)].samples,
                    repeats=stats0[int(t)].repeats, length=int(r), padded_length=int(n),
                    padded_copies=int(n - r), truncated=0, dropped=False,
                    oversubscribed=bool(n > r and r < pad_to.unit(top.dp, bs)),
                    steps=int(s))
        for (di, key), t, r, n, s in zip(table, top.tab, top.real, top.length, steps))
    plan = Plan(epoch=base.epoch, topology=topology, batch_size=bs, policy=pol, mode=base.mode,
                pad_to=pad_to, oversubscribe=base.oversubscribe, datasets=base.datasets, bucket_table=table,
                schedule=top.schedule, window=top.window, batch_step=batch_step, offsets=offsets,
                stats=stats, buckets=buckets, locality=locality, shard_window=base.shard_window,  # type: ignore[arg-type]
                sizing=batch_size, accumulation=k, seed=base.seed)
    rest.plan = plan  # its shard uses are read off the plan it belongs to
    return plan, _digest(segments, top, table)


#: each sizing's remainder planner, by the sizing's ``kind``
REMAINDER_PLANNERS: dict[str, Callable[..., tuple[Plan, str]]] = {
    "count": _count_remainder, "budget": plan_budget_remainder, "pack": pack_remainder}
