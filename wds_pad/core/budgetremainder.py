"""The remainder of a budgeted epoch: what is left of it on another DP layout, under the budget.

An epoch planned under a budget and resumed on another number of DP ranks is planned as
what remains of it (as core/remainder.py does for a fixed batch size): every entry of the
epoch not yet trained on, exactly once, in batches within the budget, padded cyclically
per bucket on the new layout (``none``: not padded), each bucket's steps a multiple of
``accumulation_steps``, in lockstep on the new ranks.

- ``locality="none"``: a level is, per bucket, a list of entries in cost order, kept as
  runs of the previous level's list (level 0: the bucket's cost order, one copy per pass).
  A segment consumes whole strata (lockstep) or, with policy ``none``, each rank's own
  members of the strata of its batches; the strata left, sorted by cost, are the next
  level's list, cut into strata of the new ``dp_size`` and packed again
  (core/strata.py). O(strata) per level to describe, O(levels x log) per entry.
- ``locality="shard"``: a level is, per bucket, each rank's entries explicitly; what the
  old ranks left of theirs, rank after rank, is dealt to the new ranks in contiguous
  blocks (so a new rank reads the remaining samples of a few old ranks' shards) and cut
  in lockstep again (core/lockstep.py). O(samples) per level, like the plan it resumes.

Invariants (tests/core/test_budgetremainder.py):
- what the earlier segments' ranks consumed plus the real entries of the remainder over
  every new rank is the epoch's real entries, each exactly once;
- every new rank has the same batch count (but for policy ``none``), a multiple of
  ``accumulation_steps``, takes the same bucket at the same step, every batch within
  the budget (a sample dearer than it alone); CP peers get identical batches;
- pure; the fingerprint is equal on every rank of the new layout.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Hashable, Sequence

import numpy as np

from ..errors import StateError, StateMismatchError
from .budget import Budget
from .budgetplan import RankCuts, shard_cut
from .dataset import as_datasets
from .lockstep import lockstep_cuts
from .locality import Locality
from .planrecord import Bins, BucketStats, Plan, Buckets, rank_batches
from .shardschedule import PlannedShardUses
from .policy import Policy, PadTo
from .schedule import step_schedule
from .sampleseed import PADDED
from .seed import derive_seed, json_digest
from .strata import BucketBatches
from .topology import Topology

__all__ = ["plan_budget_remainder"]


@dataclass(eq=False)
class _Level:
    """One level: its DP layout, kept buckets (indices of the base plan's), schedule."""

    dp: int
    tab: np.ndarray                    # base kept-bucket index of each bucket
    schedule: np.ndarray
    window: np.ndarray
    batches: list[Any] = field(default_factory=list)    # per bucket: BucketBatches (none) or RankCuts (shard)
    runs: list[Any] = field(default_factory=list)       # per bucket: (run starts, run sources) or None


def _taken(lv: _Level, seg: Any, epoch: int, counts: np.ndarray, starts: Any) -> np.ndarray:
    """Batches each rank of ``lv`` took per bucket: (buckets, dp)."""
    nb = lv.tab.size
    if seg.dp_size != lv.dp:
        raise StateError(f"an elastic segment says dp_size {seg.dp_size} where its layout had {lv.dp}")
    sched = lv.schedule.astype(np.int64)
    if seg.steps is not None:
        if seg.steps > sched.size:
            raise StateMismatchError(
                f"loader state position {seg.steps} is past the end of epoch {epoch} on dp_size {lv.dp} "
                f"({sched.size} steps); the state does not belong to this plan")
        per = np.bincount(sched[:seg.steps], minlength=nb)
        return np.repeat(per[:, None], lv.dp, axis=1)
    out = np.zeros((nb, lv.dp), np.int64)
    for d in range(lv.dp):
        step_of, _ = rank_batches(counts[:, d], [], sched, lv.window, 1, starts(d))
        pos = int(seg.positions[d])
        if pos > step_of.size:
            raise StateMismatchError(
                f"loader state position {pos} of dp_rank {d} is past the end of epoch {epoch} on dp_size "
                f"{lv.dp} ({step_of.size} batches on that rank); the state does not belong to this plan")
        reach = int(step_of[pos - 1]) + 1 if pos else 0
        out[:, d] = np.bincount(sched[:reach], minlength=nb)
    return out


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


class _StrataRemainder:
    """The top level's entries of this rank (locality none): the ``budget`` hook of a Plan."""

    def __init__(self, levels: list[_Level], base_n: Sequence[int], orders: Sequence[Any], d: int) -> None:
        self.levels, self.base_n, self.orders, self.d = levels, list(base_n), list(orders), d

    def entries(self, b: np.ndarray, k: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return self.numbered(b, k)[:2]

    def numbered(self, b: np.ndarray, k: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(sample ids, padded flags, copy numbers): the base plan's pass of each entry, plus
        ``PADDED`` for a padded copy, as ``BudgetBuckets.numbered`` numbers them."""
        top = self.levels[-1]
        b, k = np.asarray(b, np.int64), np.asarray(k, np.int64)
        samples, pad = np.empty(k.size, np.int64), np.empty(k.size, bool)
        number = np.empty(k.size, np.int64)
        for j in np.unique(b).tolist():
            sel = np.flatnonzero(b == j)
            pos, _, copies = top.batches[j].at(np.full(sel.size, self.d, np.int64), k[sel])
            code = _resolve(self.levels, j, pos)
            j0 = int(top.tab[j])
            samples[sel] = np.asarray(self.orders[j0][code % self.base_n[j0]], np.int64)
            pad[sel] = copies
            number[sel] = code // max(self.base_n[j0], 1) + PADDED * copies
        return samples, pad, number


class _ExplicitRemainder(PlannedShardUses):
    """The top level's entries of this rank (locality shard), and the shards it reads."""

    def __init__(self, top: _Level, d: int, shard_map: Sequence[Any]) -> None:
        self.top, self.d, self._shard_map = top, d, shard_map
        self.plan: Plan | None = None
        self._uses: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def entries(self, b: np.ndarray, k: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        b, k = np.asarray(b, np.int64), np.asarray(k, np.int64)
        samples, pad = np.empty(k.size, np.int64), np.empty(k.size, bool)
        for j in np.unique(b).tolist():
            sel = np.flatnonzero(b == j)
            cut: RankCuts = self.top.batches[j]
            samples[sel] = cut.ids[self.d][k[sel]]
            pad[sel] = cut.pad[self.d][k[sel]]
        return samples, pad


def plan_budget_remainder(datasets: Any, topology: Topology, segments: Sequence[Any], *, seed: int, epoch: int,
                          batch_size: Budget, policy: Policy | str, mode: Any = "epochs",
                          oversubscribe: bool = False, pad_to: PadTo | str = PadTo.BATCH,
                          locality: Locality | str = Locality.NONE, window: int = 8,
                          accumulation_steps: int = 1) -> tuple[Plan, str]:
    """This rank's plan of what ``segments`` left of a budgeted epoch, and its fingerprint.

    Raises:
        StateMismatchError: a segment goes past the end of what its layout had.
        StateError: a malformed segment.
    """
    from .plan import plan_epoch

    budget, k = batch_size, int(accumulation_steps)
    base = plan_epoch(datasets, segments[0].topology(), seed=seed, epoch=epoch,
                      batch_size=budget, policy=policy, mode=mode, oversubscribe=oversubscribe, pad_to=pad_to,
                      warn=False, locality=locality, window=window, accumulation_steps=k)
    dss = as_datasets(datasets)
    shard = base.locality.dealt
    pol = "none" if base.policy is Policy.NONE else "cyclic"
    top_up = base.pad_to is PadTo.BATCH
    nb0 = len(base.bucket_table)
    lv0 = _Level(dp=segments[0].dp_size, tab=np.arange(nb0, dtype=np.int64), schedule=base.schedule,
                 window=base.window)
    if shard:
        local = base.buckets.local
        for j, (di, key) in enumerate(base.bucket_table):
            st = _stat(base, di, key)
            lv0.batches.append(shard_cut(local, j, st.padded_length, min(st.length, st.padded_length), lv0.dp,
                                         dss[di].cost, budget, k))
        lv0.runs = [None] * nb0
    else:
        lv0.batches = list(base.buckets.order.batches)
        lv0.runs = [None] * nb0
    levels = [lv0]
    for j, seg in enumerate(segments):
        lv = levels[-1]
        dp = segments[j + 1].dp_size if j + 1 < len(segments) else int(topology.dp_size)  # type: ignore[arg-type]
        counts = np.asarray([[bb.count(d) for d in range(lv.dp)] for bb in lv.batches], np.int64).reshape(-1, lv.dp)
        starts = (lambda d, lv=lv: Bins([bb.cuts[d] if shard else bb.offsets for bb in lv.batches]))
        taken = _taken(lv, seg, epoch, counts, starts)
        nxt = _Level(dp=dp, tab=np.zeros(0, np.int64), schedule=np.zeros(0, np.int64),
                     window=np.zeros(0, np.int64))
        tab: list[int] = []
        for b, bb in enumerate(lv.batches):
            if shard:
                made = _next_shard(bb, taken[b], dp, dss[base.bucket_table[int(lv.tab[b])][0]].cost, budget, k, pol)
            else:
                di = base.bucket_table[int(lv.tab[b])][0]
                made = _next_strata(lv, b, bb, taken[b], dp, levels, base, dss[di].cost, budget, pol, top_up, k,
                                    seed, epoch, len(levels))
            if made is None:
                continue
            tab.append(int(lv.tab[b]))
            nxt.batches.append(made[0])
            nxt.runs.append(made[1])
        nxt.tab = np.asarray(tab, np.int64)
        table = [base.bucket_table[t] for t in tab]
        nxt.schedule, nxt.window = step_schedule(dss, table, [bb.batches for bb in nxt.batches], seed, epoch, group=k)
        levels.append(nxt)
    top = levels[-1]
    d = int(topology.dp_rank)  # type: ignore[arg-type]
    table = tuple(base.bucket_table[int(t)] for t in top.tab)
    counts_d = np.asarray([bb.count(d) for bb in top.batches], np.int64)
    bins = Bins([bb.cuts[d] if shard else bb.offsets for bb in top.batches])
    steps = [bb.batches for bb in top.batches]
    batch_step, offsets = rank_batches(counts_d, steps, top.schedule, top.window, 1, bins)
    if shard:
        shard_map = [dealt.layout.shard for dealt in base.buckets.local.dealt]
        src = _ExplicitRemainder(top, d, shard_map)
        buckets = Buckets([], top.dp, d, order=src, local=src, counts=counts_d)
    else:
        orders = [dss[di].sorted_by_cost(key) for di, key in base.bucket_table]
        base_n = [_stat(base, di, key).samples for di, key in base.bucket_table]
        buckets = Buckets([], top.dp, d, order=_StrataRemainder(levels, base_n, orders, d), counts=counts_d)
    stats = tuple(_top_stat(base, t, bb, top.dp, shard) for t, bb in zip(top.tab.tolist(), top.batches))
    widest = int(np.diff(bins.flat).max(initial=1)) if bins.flat.size > 1 else 1
    plan = Plan(epoch=base.epoch, topology=topology, batch_size=max(1, widest), policy=base.policy, mode=base.mode,
                pad_to=base.pad_to, oversubscribe=base.oversubscribe, datasets=base.datasets, bucket_table=table,
                schedule=top.schedule, window=top.window, batch_step=batch_step, offsets=offsets, stats=stats,
                buckets=buckets, locality=base.locality, shard_window=base.shard_window, sizing=budget, bins=bins,
                accumulation=k, seed=base.seed)
    if shard:
        src.plan = plan
    return plan, _digest(segments, top, table)


def _stat(base: Plan, di: int, key: Hashable) -> BucketStats:
    name = base.datasets[di]
    return next(s for s in base.stats if s.dataset == name and s.bucket == key)


def _top_stat(base: Plan, t: int, bb: Any, dp: int, shard: bool) -> BucketStats:
    di, key = base.bucket_table[t]
    s0 = _stat(base, di, key)
    if shard:
        real = sum(int((~p).sum()) for p in bb.pad)
        planned = sum(int(p.size) for p in bb.pad)
    else:
        real, planned = bb.real, bb.planned
    return BucketStats(dataset=s0.dataset, bucket=key, samples=s0.samples, repeats=s0.repeats, length=real,
                       padded_length=planned, padded_copies=planned - real, truncated=0, dropped=False,
                       oversubscribed=False, steps=bb.batches)


def _next_strata(lv: _Level, b: int, bb: BucketBatches, taken: np.ndarray, dp: int, levels: list[_Level],
                 base: Plan, cost: Any, budget: Budget, pol: str, top_up: bool, k: int, seed: int, epoch: int,
                 depth: int) -> tuple[BucketBatches, _Runs] | None:
    """What ranks of ``lv`` left of bucket ``b`` (which they took ``taken`` batches of, per
    rank), as the next level's list (runs of ``lv``'s codes, in cost order) and its batches."""
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
    n = runs.total
    j0 = int(lv.tab[b])
    di, key = base.bucket_table[j0]
    order0 = base.buckets.order.orders[j0]
    n0 = base.buckets.order.batches[j0].n

    def sorted_cost(pos: np.ndarray) -> np.ndarray:
        code = _resolve(levels, b, runs.prev(np.asarray(pos, np.int64)))
        return np.asarray(cost[np.asarray(order0[code % n0], np.int64)], np.float64)
    made = BucketBatches(n, 1, dp, sorted_cost, derive_seed(seed, epoch, base.datasets[di], key, "budget", depth),
                         budget, pol, True, top_up, k)
    return (made, runs) if made.batches else None


def _next_shard(cut: RankCuts, taken: np.ndarray, dp: int, cost: Any, budget: Budget, k: int,
                pol: str) -> tuple[RankCuts, None] | None:
    """What the ranks of a shard-local level left of a bucket, rank after rank, dealt to
    ``dp`` new ranks in contiguous blocks (padded cyclically unless ``none``) and cut again."""
    rest = [cut.ids[d][cut.cuts[d][min(int(taken[d]), cut.steps)]:][~cut.pad[d][cut.cuts[d][min(int(taken[d]), cut.steps)]:]]
            for d in range(len(cut.ids))]
    real = np.concatenate(rest) if rest else np.zeros(0, np.int64)
    n = int(real.size)
    if not n:
        return None
    unit = dp * k
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
    steps, cuts = lockstep_cuts(costs, counts, budget, multiple=k)
    if not steps:
        return None
    return RankCuts(per_ids, per_pad, steps, cuts), None


def _digest(segments: Sequence[Any], top: _Level, table: Sequence[tuple[int, Hashable]]) -> str:
    doc = {"kind": "wds_pad.budget_remainder/1",
           "segments": [s.to_json()[:2] + ([s.node_ranks] if s.node_ranks else []) for s in segments], "dp": top.dp,
           "table": [[int(di), repr(key)] for di, key in table],
           "steps": [int(bb.batches) for bb in top.batches],
           "schedule": np.asarray(top.schedule, np.int64).tolist()}
    return json_digest(doc, size=16)
