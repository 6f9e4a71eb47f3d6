"""What every level walk of an elastic remainder (core/elastic/remainder.py) shares: the
top level and its schedule, what a segment took of it (one walk for lockstep steps and
per-rank positions), a level's list as :class:`Runs` of the previous one's, the top
level's stats and the remainder's digest.

A level kind orders each bucket's list and cuts it into batches (core/elastic/listlevels.py,
core/elastic/stratalevels.py); it gives this walk how many batches each rank has of each
bucket, and gets back how many of them each rank took.

Invariants: those of core/elastic/remainder.py; the digest depends on the segments and the
top level alone, in the format its sizing's saved states carry.
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable, Hashable, Sequence

import numpy as np

from ...errors import StateMismatchError
from ..planning.planrecord import BucketStats, Plan
from ..policy import Policy
from ..seed import json_digest

__all__ = ["Levels", "Runs", "remainder_digest"]


class Levels:
    """The levels of a remainder (a kind's below it), from the base plan on: the base plan
    and its buckets' stats, the top level and its schedule, what a segment took of it,
    and the top level's stats."""

    def __init__(self, base: Plan, dss: Sequence[Any], sizing: Any, accumulation_steps: int, seed: int,
                 epoch: int) -> None:
        self.base, self.dss, self.sizing, self.seed, self.epoch = base, dss, sizing, seed, epoch
        self.accumulation_steps = accumulation_steps
        # a level is padded cyclically whatever the policy (drop would lose entries not yet trained), or not at all
        self.policy = Policy.NONE if base.policy is Policy.NONE else Policy.CYCLIC
        by_name = {(s.dataset, s.bucket): s for s in base.stats}
        self.stats0 = [by_name[(base.datasets[di], key)] for di, key in base.bucket_table]
        self.levels: list[Any] = []

    @property
    def top(self) -> Any:
        return self.levels[-1]

    def unit(self, dp: int) -> int:
        """What a level on ``dp`` ranks pads each bucket's list to a multiple of."""
        return self.sizing.pad_unit(dp, self.base.pad_to, self.accumulation_steps)  # type: ignore[no-any-return]

    def took(self, seg: Any, have: Callable[[], np.ndarray] | None = None) -> np.ndarray:
        """Batches each rank of the top level took per bucket: shape (buckets, dp), or
        (buckets, 1) for a lockstep segment (every rank alike). ``have()`` gives how many
        batches rank d has of bucket b (its first ones: it lacks a bucket's batch at window w
        when w >= have[b, d]), needed for per-rank positions only.

        Ranks differ only at the steps some of them lack (policy ``none``), so each rank's
        position maps to a step in O(those steps), not by walking the rank's plan.

        Raises:
            StateMismatchError: a segment goes past the end of what a rank had.
        """
        lv = self.top
        nb = lv.tab.size
        if seg.steps is not None:
            if seg.steps > lv.schedule.size:
                raise StateMismatchError(
                    f"loader state position {seg.steps} is past the end of epoch {self.epoch} on dp_size {lv.dp} "
                    f"({lv.schedule.size} steps); the state does not belong to this plan")
            return np.bincount(lv.schedule[:seg.steps].astype(np.int64), minlength=nb)[:, None]
        have = have()  # type: ignore[misc]
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
                f"loader state position {int(pos[d])} of dp_rank {d} is past the end of epoch {self.epoch} on "
                f"dp_size {lv.dp} ({int(total[d])} batches on that rank); the state does not belong to this plan")
        took = np.zeros((nb, lv.dp), np.int64)
        order = np.argsort(sched, kind="stable")  # each bucket's steps, ascending
        bounds = np.searchsorted(sched[order], np.arange(nb + 1))
        for b in range(nb):
            took[b] = np.searchsorted(order[bounds[b]:bounds[b + 1]], reach)
        return took

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


class Runs:
    """A level's list as runs of the previous level's (one concept for every level kind).

    Run q holds the list's indices ``[start[q], start[q + 1])``; at its offset o it holds
    entry ``first[q] + stride[q] * (o // mult[q])`` of the previous list, in pass
    ``passes[q, o % mult[q]]``: that entry's code ``pass * n + index`` (one pass, mult 1,
    but from a budget's level 0, whose list holds every pass of its cost order).
    """

    def __init__(self, sizes: np.ndarray, first: np.ndarray, stride: np.ndarray | None = None,
                 mult: np.ndarray | None = None, passes: np.ndarray | None = None, n: int = 0) -> None:
        self.first, self.mult, self.passes, self.n = first, mult, passes, n
        self.stride = np.ones(first.size, np.int64) if stride is None else stride
        sizes = sizes if mult is None else sizes * mult
        self.start = np.zeros(sizes.size, np.int64)
        np.cumsum(sizes[:-1], out=self.start[1:])
        self.total = int(sizes.sum())

    def prev(self, idx: np.ndarray) -> np.ndarray:
        """The previous list's codes of entries ``idx`` of this one."""
        q = np.searchsorted(self.start, idx, side="right") - 1
        off = idx - self.start[q]
        if self.mult is None:  # one pass
            return self.first[q] + self.stride[q] * off  # type: ignore[no-any-return]
        m = self.mult[q]
        return self.passes[q, off % m] * self.n + self.first[q] + self.stride[q] * (off // m)  # type: ignore[index]


def remainder_digest(kind: str, segments: Sequence[Any], table: Sequence[tuple[int, Hashable]], top: Any,
                     steps: Sequence[int]) -> str:
    """The fingerprint of a remainder: its segments (each one's layout and how far it got),
    its top level's layout, bucket table, steps and schedule. A count's remainder states
    its level's real and planned entries per bucket (``repr`` + blake2b, as its saved
    states carry it), a budget's its steps per bucket (JSON, ``json_digest``)."""
    keys = [s.to_json()[:2] + ([s.node_ranks] if s.node_ranks else []) for s in segments]
    tab = [[int(di), repr(key)] for di, key in table]
    if kind == "count":
        h = hashlib.blake2b(digest_size=16)
        h.update(repr(("wds_pad.remainder", 1, keys, top.dp, top.deal, [tuple(t) for t in tab])).encode())
        for a in (top.real, top.length, top.schedule):
            h.update(np.ascontiguousarray(a, dtype=np.int64).tobytes())
        return h.hexdigest()
    return json_digest({"kind": "wds_pad.budget_remainder/1", "segments": keys, "dp": top.dp, "table": tab,
                        "steps": [int(s) for s in steps], "schedule": np.asarray(top.schedule, np.int64).tolist()},
                       size=16)
