"""The remainder of an epoch: what is left of it after earlier DP layouts consumed a part.

An epoch resumed on another number of DP ranks is planned as what remains of it: every
entry of the epoch not yet trained on, exactly once, padded per bucket to the new
layout's pad unit (cyclically, copies marked; ``none``: not padded), scheduled in
lockstep on the new ranks. Pure (no I/O, no clock): the same (datasets, seed, epoch,
policy, segments, topology) give the same plan.

One composition for every sizing and every entry order. Level 0 is the epoch planned on
the first layout (``plan_epoch``); segment j says how far the ranks of level j's layout got
(``steps`` in lockstep, or each DP rank's batch index with policy ``none``); level j + 1 is
what it left, dealt to the next layout's ranks. This module walks the levels, schedules
each (core/planning/schedule.py) and makes the top level's Plan; what a level is, chosen from
:data:`REMAINDER_LEVELS` by the sizing's ``kind`` and the locality, is a list of runs of the
previous level's cut by a count or in lockstep under a budget, or a budget's strata (a
Pack's: its budget's, every segment counted in packs, grouped into batches of B packs again).

Invariants (tests/core/test_remainder.py, test_budgetremainder.py, test_packplan.py):
- the union over earlier segments of what their ranks consumed, plus the real entries
  of the remainder over every new rank, is the epoch's real entries, each exactly once;
- every new rank gets the same batch count (policy ``none`` aside), a multiple of
  ``accumulation_steps``; all take the same bucket at the same step, and CP peers (same
  dp_rank) get identical batches;
- buckets left empty contribute nothing; the plan and its fingerprint are bitwise
  identical on every rank of the new layout.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

from ...errors import ConfigError, StateError
from ..budgets.budget import Budget
from ..dataset import as_datasets
from .levels import remainder_digest
from .listlevels import ListLevels, LockstepLevels
from .stratalevels import StrataLevels
from ..local.locality import Locality
from ..budgets.packing import Pack
from ..budgets.packplan import group_plan
from ..planning.plan import plan_epoch
from ..planning.planrecord import Buckets, Plan, rank_batches
from ..policy import PadTo, Policy
from ..planning.schedule import step_schedule
from ..sizing import Count, as_sizing
from ..topology import Topology

__all__ = ["REMAINDER_LEVELS", "Remainder", "Segment", "plan_remainder"]


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


#: what a level of the remainder is, by the sizing's ``kind`` (a Pack's is its budget's) and
#: whether shards are dealt: runs of the previous level's list cut by a count or in lockstep
#: under a budget (core/elastic/listlevels.py), or a budget's strata (core/elastic/stratalevels.py)
REMAINDER_LEVELS: dict[tuple[str, bool], Callable[..., Any]] = {
    ("count", False): ListLevels, ("count", True): ListLevels,
    ("budget", False): StrataLevels, ("budget", True): LockstepLevels}


def plan_remainder(datasets: Any, topology: Topology, segments: Sequence[Segment], *, seed: int, epoch: int,
                   batch_size: int | Count | Budget | Pack, policy: Policy | str, mode: Any = "epochs",
                   oversubscribe: bool = False, pad_to: PadTo | str = PadTo.BATCH,
                   locality: Locality | str = Locality.NONE, window: int = 8, accumulation_steps: int = 1,
                   mix_by: str = "samples", epoch_size: float | None = None) -> Remainder:
    """This rank's plan of what ``segments`` left of ``epoch`` (see the module docstring).

    Args:
        datasets, seed, epoch, batch_size, policy, mode, oversubscribe, pad_to, locality,
            window, accumulation_steps: as for ``plan_epoch`` (the same for every layout of
            the epoch).
        topology: this rank's (new) topology.
        segments: the earlier layouts in order, each with how far its ranks got; at least one.

    Raises:
        StateMismatchError: a segment goes past the end of what its layout had.
        StateError: a malformed segment.
        ConfigError: the epoch was planned with proportions.
    """
    if not segments:
        raise StateError("plan_remainder needs at least one segment")
    if any(ds.proportion is not None for ds in as_datasets(datasets)):
        raise ConfigError("an epoch planned with proportions resumes on the layout it was saved on: its elastic "
                          "remainder (another number of DP ranks) is not planned; restart with the saved topology")
    sizing = as_sizing(batch_size)
    common = dict(seed=seed, epoch=epoch, policy=policy, mode=mode, oversubscribe=oversubscribe, pad_to=pad_to,
                  locality=locality, window=window)
    accumulation_steps = int(accumulation_steps)
    if sizing.kind != "pack":
        return Remainder(*_remaining(datasets, topology, segments, sizing=sizing,
                                     accumulation_steps=accumulation_steps, **common))
    # a Pack: the remainder of its packs (B a batch), every segment counted in packs, grouped again
    B = sizing.packs  # type: ignore[union-attr]
    segs = [replace(s, steps=None if s.steps is None else s.steps * B,
                    positions=None if s.positions is None else tuple(p * B for p in s.positions))
            for s in segments]
    plan, digest = _remaining(datasets, topology, segs, sizing=sizing.budget(),  # type: ignore[union-attr]
                              accumulation_steps=accumulation_steps * B, **common)
    return Remainder(group_plan(plan, sizing, accumulation_steps), digest)  # type: ignore[arg-type]


def _remaining(datasets: Any, topology: Topology, segments: Sequence[Segment], *, sizing: Count | Budget,
               seed: int, epoch: int, policy: Policy | str, mode: Any, oversubscribe: bool, pad_to: PadTo | str,
               locality: Locality | str, window: int, accumulation_steps: int) -> tuple[Plan, str]:
    """The remainder's Plan of this rank and its fingerprint, for a count or a budget."""
    base = plan_epoch(datasets, segments[0].topology(), seed=seed, epoch=epoch, batch_size=sizing, policy=policy,
                      mode=mode, oversubscribe=oversubscribe, pad_to=pad_to, warn=False, locality=locality,
                      window=window, accumulation_steps=accumulation_steps)
    dss = as_datasets(datasets)
    levels = REMAINDER_LEVELS[sizing.kind, base.locality.dealt](base, dss, sizing, accumulation_steps, seed,
                                                                epoch, segments[0].dp_size)
    for j, seg in enumerate(segments):
        if seg.dp_size != levels.top.dp:
            raise StateError(f"an elastic segment says dp_size {seg.dp_size} where its layout had {levels.top.dp}")
        dp = segments[j + 1].dp_size if j + 1 < len(segments) else int(topology.dp_size)  # type: ignore[arg-type]
        tab, steps = levels.advance(seg, dp)
        table = [base.bucket_table[int(t)] for t in tab]
        levels.top.schedule, levels.top.window = step_schedule(dss, table, steps, seed, epoch,
                                                               accumulation_steps=accumulation_steps)
    top = levels.top
    d = int(topology.dp_rank)  # type: ignore[arg-type]
    table = tuple(base.bucket_table[int(t)] for t in top.tab)
    counts, steps, bins, order, local, stats = levels.rank(d, table)
    width = base.batch_size if bins is None else bins.widest
    batch_step, offsets = rank_batches(counts, steps, top.schedule, top.window, width, bins)
    buckets = Buckets([], top.dp, d, order=order, local=local, counts=counts)
    plan = replace(base, topology=topology, batch_size=width, bucket_table=table, schedule=top.schedule,
                   window=top.window, batch_step=batch_step, offsets=offsets, stats=stats, buckets=buckets, bins=bins,
                   pad_unit=levels.unit(top.dp))
    if local is not None:
        local.plan = plan  # its shard uses are read off the plan it belongs to
    return plan, remainder_digest(sizing.kind, segments, table, top, steps)

