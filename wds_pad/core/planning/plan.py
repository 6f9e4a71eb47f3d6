"""The pure planner: (datasets, topology, seed, epoch, policy) -> this rank's batches.

No I/O, no torch, no clock: the same inputs give a bitwise identical plan in every
process. Per (dataset, bucket), identically on every rank:

1. sample ids in sorted order, shuffled by a keyed pseudorandom permutation whose key
   derives from (seed, epoch, dataset, bucket, pass); with ``repeats`` r the bucket
   holds 1 + r independently shuffled passes, concatenated before anything is split.
   The permutation is evaluated only at this rank's positions (``Buckets.at``), so a
   rank's plan costs O(samples / dp_size), not a full shuffle of every bucket;
2. a bucket smaller than one pad unit is dropped (a DroppedBucketWarning names it)
   unless ``oversubscribe`` lets the cyclic extension fill it to one whole unit;
3. ``cyclic`` extends the list by its own prefix to the next multiple of the pad unit
   (extra entries are marked as padded copies), ``drop`` truncates to the multiple,
   ``none`` leaves it uneven;
4. dp_rank d takes global positions p with p mod dp_size == d (``policy.rank_position``)
   and the sizing's cut makes them batches, so each global step is one contiguous window
   of the bucket's order and context-parallel peers get identical batches;
5. a schedule derived from (seed, epoch) interleaves the buckets' windows (each bucket's
   windows in order; datasets merged as Poisson processes with rates equal to their
   weights), so all ranks take the same (dataset, bucket) at the same step.

Empty buckets never reach the padding arithmetic. All per-sample work is numpy.

Invariants (hypothesis properties in tests/core/test_plan.py, for both localities):
- every DP rank gets the same number of batches and all ranks take the same (dataset,
  bucket) at the same step; CP peers get identical batches;
- over all DP ranks an epoch is exactly the padded bucket lists, copies marked padded;
- the same inputs give a bitwise identical plan in every process, under any
  PYTHONHASHSEED; epoch e + 1 is planned with the same policy as epoch e;
- a wrong argument is a ConfigError naming it, before anything is allocated.
"""

from __future__ import annotations

import os
import sys
import warnings
from functools import partial
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from ...errors import ConfigError, DroppedBucketWarning
from ..budgets.budget import Budget
from ..budgets.budgetplan import budget_cut
from .buckettable import BucketCut, BucketTable, Planning, SizedBuckets, bucket_table, padded
from ..dataset import Dataset, as_datasets
from ..local.localbuckets import LocalBuckets
from ..local.locality import Locality
from ..budgets.packplan import PackCut
from ..permute import round_keys
from .planrecord import Batch, Bins, BucketStats, Plan, Buckets, rank_batches
from .proportion import extended, mix
from ..policy import (Mode, PadTo, Policy, check_epoch, check_flag, check_positive, parse_enum, rank_share,
                      resolve_policy)
from .schedule import step_schedule
from ..seed import check_seed, derive_seed
from ..sizing import Count, Sizing, as_sizing
from ..topology import Topology

__all__ = ["Batch", "BucketStats", "Plan", "iter_steps", "plan_epoch"]


# wds_pad itself (the package, wherever this module sits in it) and the standard library:
# a warning's frame is never one of theirs
_PACKAGE = sys.modules[__name__.split(".")[0]]
_LIBRARY_DIRS = (os.path.dirname(os.path.abspath(_PACKAGE.__file__ or "")) + os.sep,
                 os.path.dirname(os.path.abspath(warnings.__file__)) + os.sep)


def user_stacklevel() -> int:
    """The ``stacklevel`` that points a warning raised by our caller at the user's line:
    the first frame outside wds_pad, webdataset, torch and the standard library."""
    skip = list(_LIBRARY_DIRS)
    for mod in ("webdataset", "torch"):
        m = sys.modules.get(mod)
        if m is not None and getattr(m, "__file__", None):
            skip.append(os.path.dirname(os.path.abspath(m.__file__)) + os.sep)
    frame, level = sys._getframe(2), 2  # level 1 is our caller's warnings.warn line
    while frame is not None:
        name = os.path.abspath(frame.f_code.co_filename)
        if not name.startswith(tuple(skip)) and not name.startswith("<frozen"):
            return level
        frame, level = frame.f_back, level + 1
    return 2


def plan_epoch(
    datasets: Any,
    topology: Topology,
    *,
    seed: int,
    epoch: int = 0,
    batch_size: int | Count | Budget,
    policy: Policy | str = Policy.AUTO,
    mode: Mode | str = Mode.EPOCHS,
    oversubscribe: bool = False,
    pad_to: PadTo | str = PadTo.BATCH,
    warn: bool = True,
    locality: Locality | str = Locality.NONE,
    window: int = 8,
    accumulation_steps: int = 1,
    mix_by: str = "samples",
    epoch_size: float | None = None,
) -> Plan:
    """Plan one epoch for this rank.

    Args:
        datasets: a Dataset, an Index (anything with ``to_dataset()``), a mapping of
            bucket key -> sample ids, or a list of those (several datasets).
        topology: this rank's Topology.
        seed: the shared seed (identical on every rank), an int in [0, 2**64).
        epoch: the epoch number, an int in [0, MAX_EPOCH].
        batch_size: samples per batch per DP rank (an int or a
            :class:`~wds_pad.core.sizing.Count`), or a :class:`~wds_pad.core.budgets.budget.Budget`
            (batches sized by the samples' costs: every dataset needs costs).
        policy: ``auto`` | ``cyclic`` | ``drop`` | ``none``.
        mode: ``epochs`` | ``steps`` (only matters for ``auto``).
        oversubscribe: keep buckets smaller than one pad unit, filled cyclically.
        pad_to: ``batch`` (unit dp_size * batch_size; under a budget, a bucket's last
            batch topped up with copies) or ``rank`` (unit dp_size).
        warn: emit a DroppedBucketWarning naming each dropped bucket.
        locality: ``none`` (every bucket shuffled across all shards), ``shard`` (each
            rank reads its own shards, dealt per epoch, through a window of shards) or
            ``node`` (shards dealt to nodes for good, read by a node's ranks together;
            needs ``topology.local_world_size``); core/local/locality.py. ``shard`` and ``node``
            need an Index or a ShardMap per dataset.
        window: shards a rank (a node) visits at once with ``locality="shard"`` (``"node"``).
        accumulation_steps: K micro-batches per optimizer step: every rank's batch count
            is a multiple of K and each run of K steps reads one bucket.
        mix_by: with proportions (``Dataset(proportion=...)``), count each dataset's share
            in ``samples`` or in ``cost`` (core/planning/proportion.py).
        epoch_size: with proportions, the epoch's samples (or cost); None: the datasets' own.

    Returns:
        The Plan of ``topology.rank`` for ``epoch``.

    Raises:
        ConfigError: a wrong argument, named with the expected form; under a Budget or a
            Pack, a dataset without costs.
    """
    if not isinstance(topology, Topology):
        raise ConfigError(f"topology must be a wds_pad.Topology, got {type(topology).__name__}")
    seed = check_seed(seed)
    epoch = check_epoch(epoch)
    sizing = as_sizing(batch_size)
    mode = parse_enum(Mode, mode, "mode")
    pad_to = parse_enum(PadTo, pad_to, "pad_to")
    oversubscribe = check_flag("oversubscribe", oversubscribe)
    policy = resolve_policy(policy, mode, oversubscribe)
    locality = parse_enum(Locality, locality, "locality")
    shard_window = check_positive("window", window)
    accumulation_steps = _check_accumulation(accumulation_steps, policy, pad_to, sizing)
    node_ranks = topology.node_ranks if locality is Locality.NODE else 1
    raw = list(datasets) if isinstance(datasets, (list, tuple)) else [datasets]
    mixed = mix(as_datasets(datasets), seed, epoch, mix_by, epoch_size)
    dss = mixed.datasets
    if mixed.targets is not None and sizing.kind != "count":
        raise ConfigError("proportions are planned with batches of a sample count (batch_size=N, --batch-size), "
                          f"not with {sizing.describe()}; drop the proportions or the budget")
    for ds in dss if sizing.needs_costs else ():
        ds.require_costs()
    at = Planning(seed=seed, epoch=epoch, dp=int(topology.dp_size), d=int(topology.dp_rank),  # type: ignore[arg-type]
                  policy=policy, oversubscribe=oversubscribe, pad_to=pad_to,
                  accumulation_steps=accumulation_steps,
                  locality=locality, window=shard_window, node_ranks=node_ranks, targets=mixed.targets)
    sized = plan_buckets(raw, dss, sizing, at)
    got = sized.buckets
    _warn_dropped(warn, got.dropped, got.dropped_samples, got.total_samples, epoch)

    table = got.table
    schedule, window_of = step_schedule(dss, table, sized.steps, seed, epoch, accumulation_steps=accumulation_steps)
    if sized.local is not None:  # a window's span of the epoch, in steps
        sized.local.set_steps(int(schedule.size))
    buckets = Buckets(sized.keyed, at.dp, at.d, order=sized.order, local=sized.local, counts=sized.counts)
    bins = Bins(sized.starts) if sized.starts is not None else None
    width = sizing.batch_size if bins is None else bins.widest  # type: ignore[union-attr]
    batch_step, offsets = rank_batches(buckets.counts, sized.steps, schedule, window_of, width, bins)
    return Plan(
        epoch=epoch, topology=topology, batch_size=width, policy=policy, mode=mode, pad_to=pad_to,
        oversubscribe=oversubscribe, datasets=tuple(ds.name for ds in dss),
        bucket_table=tuple(table), schedule=schedule, window=window_of, batch_step=batch_step,
        offsets=offsets, stats=tuple(got.stats), buckets=buckets, locality=locality,
        shard_window=shard_window, sizing=sizing, bins=bins,
        accumulation_steps=accumulation_steps, packs=sized.packs, seed=seed, pad_unit=got.unit,
    )


def plan_buckets(raw: Sequence[Any], dss: Sequence[Dataset], sizing: Sizing, at: Planning) -> SizedBuckets:
    """The one bucket planner: the sizing's cut (``BUCKET_CUTS[sizing.kind]``) measures every
    bucket through the bucket table, the shard-local order is drawn over the kept buckets
    with locality ``shard`` or ``node``, and the cut says each kept bucket's steps and this
    rank's entries and batches."""
    cut = BUCKET_CUTS[sizing.kind](sizing, at, dss)
    got = bucket_table(dss, cut.measure, epoch=at.epoch, dp=at.dp, batch=cut.batch, unit=cut.unit,
                       oversubscribe=at.oversubscribe, size=cut.size)
    sized = cut.cut(dss, got, LocalBuckets(raw, dss, got.kept, at) if at.locality.dealt else None)
    got.with_steps(sized.steps)
    return sized


class CountCut:
    """The bucket cut of a :class:`~wds_pad.core.sizing.Count`: every bucket padded to the
    pad unit (proportions: to its target length), a rank's entries cut into batches of
    ``batch_size`` (the last of a bucket shorter with ``pad_to="rank"`` or ``policy="none"``),
    in the keyed global order or the shard-local one."""

    def __init__(self, sizing: Count, at: Planning, dss: Sequence[Dataset]) -> None:
        self.at, self.batch, self.size = at, sizing.batch_size, sizing.describe()
        self.unit = sizing.pad_unit(at.dp, at.pad_to, at.accumulation_steps)
        self.measure = padded(self.unit, at.policy, at.oversubscribe, lambda length: sizing.steps(length, at.dp))
        if at.targets is not None:
            self.measure = extended(self.measure, at.targets, [ds.name for ds in dss])

    def cut(self, dss: Sequence[Dataset], got: BucketTable, local: Any) -> SizedBuckets:
        at = self.at
        # one keyed permutation per pass: each kept bucket's global order, evaluated pointwise
        keyed = [(kb.ids, kb.n, kb.n * kb.passes,
                  [round_keys(derive_seed(at.seed, at.epoch, dss[kb.di].name, kb.key, "shuffle", j))
                   for j in range(kb.passes)]) for kb in got.kept]
        return SizedBuckets(got, steps=[got.stats[kb.stat].steps for kb in got.kept],
                            counts=rank_share([kb.length for kb in got.kept], at.dp, at.d), starts=None,
                            order=local, local=local, keyed=keyed)


#: each sizing's bucket cut (core/planning/buckettable.py's ``BucketCut``), by the sizing's ``kind``
BUCKET_CUTS: dict[str, Callable[..., BucketCut]] = {
    "count": CountCut, "budget": budget_cut, "pack": partial(PackCut, budget_cut)}


def _check_accumulation(value: Any, policy: Policy, pad_to: PadTo, sizing: Sizing) -> int:
    steps = check_positive("accumulation_steps", value)
    if steps > 1 and policy is Policy.NONE:
        raise ConfigError(
            f"accumulation_steps={steps} with padding policy 'none': 'none' gives ranks different batch "
            "counts, so an epoch could not end on a whole optimizer step on every rank; use pad='cyclic' "
            "or 'drop', or accumulation_steps=1")
    if steps > 1 and sizing.short_last_batch(pad_to):
        raise ConfigError(
            f"accumulation_steps={steps} with pad_to='rank': a bucket's last batch may then be short, so its "
            "optimizer step would mix a short micro-batch with full ones; use pad_to='batch' (a bucket "
            "padded to whole optimizer steps), or accumulation_steps=1")
    return steps


def _warn_dropped(warn: bool, names: list[str], dropped: int, total: int, epoch: int) -> None:
    if not (warn and names):
        return
    warnings.warn(
        f"{len(names)} bucket(s) smaller than one global step were dropped from "
        f"epoch {epoch}: {', '.join(names[:10])}{' ...' if len(names) > 10 else ''}; "
        f"they hold {dropped} of the epoch's {total} samples "
        f"({100 * dropped / max(total, 1):.1f}%), which this epoch does not train on. "
        "Pass oversubscribe=True (--oversubscribe) to keep them: each is then filled cyclically "
        "to one global step, so its samples appear more often than the others'",
        DroppedBucketWarning,
        stacklevel=user_stacklevel(),
    )


def iter_steps(
    datasets: Any, topology: Topology, *, seed: int, batch_size: int | Count | Budget, start_epoch: int = 0,
    policy: Policy | str = Policy.AUTO, oversubscribe: bool = False,
    pad_to: PadTo | str = PadTo.BATCH, locality: Locality | str = Locality.NONE, window: int = 8,
    accumulation_steps: int = 1, mix_by: str = "samples", epoch_size: float | None = None,
) -> Iterator[Plan]:
    """Steps mode: an endless sequence of epoch plans, each with the same policy.

    Raises:
        ConfigError: ``start_epoch`` is not an int in [0, MAX_EPOCH]; or the epoch plan
            has no steps at all (every bucket dropped), which would otherwise loop forever.
    """
    epoch = check_epoch(start_epoch, "start_epoch")
    dss = datasets if isinstance(datasets, (list, tuple)) else [datasets]
    while True:
        plan = plan_epoch(dss, topology, seed=seed, epoch=epoch, batch_size=batch_size,
                          policy=policy, mode=Mode.STEPS, oversubscribe=oversubscribe,
                          pad_to=pad_to, warn=epoch == start_epoch, locality=locality, window=window,
                          accumulation_steps=accumulation_steps, mix_by=mix_by, epoch_size=epoch_size)
        if plan.steps == 0:
            raise ConfigError(
                "steps mode has nothing to stream: every bucket is smaller than one global "
                f"step ({topology.dp_size} DP ranks x batch {batch_size}); lower batch_size "
                "or pass oversubscribe=True"
            )
        yield plan
        epoch += 1
