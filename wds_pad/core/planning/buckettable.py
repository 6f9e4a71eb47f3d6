"""The bucket table: which buckets an epoch keeps, pads or drops, decided once for any sizing.

``bucket_table`` walks every (dataset, bucket) in order and asks the sizing's ``measure``
what it makes of the bucket (its padded length, its real entries, its steps); it applies
the size guard (``check_bucket_size``, ``check_planned_total``) and writes the
``BucketStats``, so every sizing keeps, pads and drops by one loop. :func:`padded` is the
measure of the pad rule (``padded_length`` to a pad unit); a budget's strata measure
themselves (core/budgets/budgetplan.py). A :class:`BucketCut` is what a sizing gives the one
bucket planner (core/planning/plan.py's ``plan_buckets``): its pad unit, its measure, and
how the kept buckets are cut into batches, as :class:`SizedBuckets`: the table, each kept
bucket's steps, this rank's entries per bucket, where its batches start, and the entry
order they come from.

Invariants:
- an empty bucket is never measured (invariant 5): its stats say 0 everywhere;
- a bucket is refused (ConfigError) when its entries exceed MAX_PLANNED_ENTRIES before it
  is measured (nothing allocated), or its padded length after; an epoch when the kept
  buckets together do;
- the table lists kept buckets in dataset order, then each dataset's bucket order.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable, Hashable, Protocol, Sequence

import numpy as np

from .planrecord import BucketStats, EntryOrder
from ..policy import PadTo, Policy, check_bucket_size, check_planned_total, padded_length

if TYPE_CHECKING:
    from ..dataset import Dataset
    from ..local.locality import Locality

__all__ = ["BucketCut", "BucketTable", "Kept", "Measured", "Planning", "SizedBuckets", "bucket_table", "padded"]


@dataclass(frozen=True)
class Planning:
    """The plan's arguments every bucket cut reads (validated by ``plan_epoch``)."""

    seed: int
    epoch: int
    dp: int                  # DP ranks
    d: int                   # this rank's dp_rank
    policy: Policy           # resolved: never AUTO
    oversubscribe: bool
    pad_to: PadTo
    accumulation_steps: int
    locality: Locality
    window: int              # shards a rank (a node) visits at once
    node_ranks: int          # DP ranks per node with locality "node" (its shards dealt to them), else 1
    targets: Any = None      # proportions: each extended bucket's target entries (core/planning/proportion.py), or None


@dataclass(frozen=True)
class Measured:
    """What a sizing makes of one non-empty bucket of ``m`` entries."""

    length: int          # padded length over all ranks (0: dropped)
    real: int            # entries of it that are samples (not padded copies)
    truncated: int       # entries dropped by the policy
    steps: int           # global steps it takes (0 when known only later)
    oversubscribed: bool
    dropped_why: str     # how the warning says why it was dropped: "(m < pad unit u)"
    cut: Any = None      # the sizing's own batches of it (a budget's strata), or None


@dataclass(frozen=True)
class Kept:
    """A kept bucket: dataset ``di``'s bucket ``key`` of ``n`` samples in ``passes`` passes."""

    di: int
    key: Hashable
    ids: Any
    n: int
    passes: int
    length: int
    stat: int            # its place in the table's stats
    cut: Any = None


@dataclass
class BucketTable:
    """Every bucket's stats, and the kept ones in table order."""

    stats: list[BucketStats]
    kept: list[Kept]
    dropped: list[str]   # "name/key (why)" of each dropped bucket
    dropped_samples: int
    total_samples: int
    unit: int = 0  # the pad unit the buckets were measured against (the sizing's cut's)

    @property
    def table(self) -> list[tuple[int, Hashable]]:
        return [(k.di, k.key) for k in self.kept]

    def with_steps(self, steps: Sequence[int]) -> None:
        """Record each kept bucket's steps, known once its batches are cut."""
        for k, st in zip(self.kept, steps):
            if self.stats[k.stat].steps != st:
                self.stats[k.stat] = replace(self.stats[k.stat], steps=int(st))


@dataclass
class SizedBuckets:
    """What a sizing's bucket cut decides for the planner to schedule."""

    buckets: BucketTable
    steps: list[int]                  # global steps per kept bucket (a multiple of accumulation_steps)
    counts: np.ndarray                # this rank's entries per kept bucket
    starts: list[np.ndarray] | None   # where each of this rank's batches starts per kept bucket (None: every
                                      # batch batch_size entries)
    order: EntryOrder | None          # where entries come from (None: the keyed order of core/planning/planrecord.py)
    local: Any = None                 # the shard-local order (LocalBuckets), whose set_steps takes the schedule
    keyed: list[tuple[Any, int, int, list[list[int]]]] = field(default_factory=list)  # Buckets' keyed order
    packs: Any = None                 # a Pack's pack of each entry (core/budgets/packplan.py's PackNumbers), or None


class BucketCut(Protocol):
    """What a sizing gives the bucket planner, made from (sizing, Planning, datasets) by the
    function core/planning/plan.py's ``BUCKET_CUTS`` names for its ``kind``."""

    unit: int   # the pad unit (as the size guard names it)
    batch: int  # samples per batch (as the size guard names it; 1 under a budget)
    size: str   # the sizing, as the size guard names it

    def measure(self, ds: Dataset, key: Hashable, ids: Any, n: int, passes: int) -> Measured:
        """What the sizing makes of one non-empty bucket (for :func:`bucket_table`)."""

    def cut(self, dss: Sequence[Dataset], got: BucketTable, local: Any) -> SizedBuckets:
        """The kept buckets of ``got`` cut into this rank's batches; ``local``: the
        shard-local order (core/local/localbuckets.py) with locality ``shard`` or ``node``, else None."""


def padded(unit: int, policy: Policy, oversubscribe: bool,
           steps_of: Callable[[int], int] | None) -> Callable[..., Measured]:
    """The measure of the pad rule: ``padded_length`` to ``unit``; a bucket's steps are
    ``steps_of(length)`` (None: known only once cut)."""

    def measure(ds: Dataset, key: Hashable, ids: Any, n: int, passes: int) -> Measured:
        m = n * passes
        length = padded_length(m, unit, policy, oversubscribe)
        steps = steps_of(length) if length and steps_of else 0
        return Measured(length=length, real=min(m, length), truncated=max(m - length, 0), steps=steps,
                        oversubscribed=0 < m < unit <= length, dropped_why=f"({m} < pad unit {unit})")
    return measure


def bucket_table(dss: Sequence[Dataset], measure: Callable[..., Measured], *, epoch: int, dp: int,
                 batch: int, unit: int, oversubscribe: bool, size: str) -> BucketTable:
    """Keep, pad or drop every bucket of ``dss`` as ``measure(ds, key, ids, n, passes)`` says
    of each non-empty one, with the size guard (a ConfigError past MAX_PLANNED_ENTRIES,
    whose message names the plan's ``epoch``, ``dp``, ``batch``, ``unit`` and sizing ``size``)."""
    stats: list[BucketStats] = []
    kept: list[Kept] = []
    dropped: list[str] = []
    dropped_samples = total = planned = 0
    for di, ds in enumerate(dss):
        passes = 1 + ds.repeats
        for key, ids in ds.buckets.items():
            n = int(ids.size)
            total += n
            m = n * passes
            check_bucket_size(ds.name, key, n, passes, 0, dp, batch, unit, oversubscribe)  # before measuring
            got = measure(ds, key, ids, n, passes) if n else Measured(0, 0, 0, 0, False, "")
            check_bucket_size(ds.name, key, n, passes, got.length, dp, batch, unit, oversubscribe)
            planned += got.length
            drop = n > 0 and got.length == 0
            stats.append(BucketStats(
                dataset=ds.name, bucket=key, samples=n, repeats=ds.repeats, length=m,
                padded_length=got.length, padded_copies=max(got.length - got.real, 0),
                truncated=got.truncated if n else 0, dropped=drop, oversubscribed=bool(n) and got.oversubscribed,
                steps=got.steps))
            if drop:
                dropped.append(f"{ds.name}/{key!r} {got.dropped_why}")
                dropped_samples += n
            elif n:
                kept.append(Kept(di, key, ids, n, passes, got.length, len(stats) - 1, got.cut))
    check_planned_total(planned, epoch, size, dp)
    return BucketTable(stats, kept, dropped, dropped_samples, total, unit)
