"""The pure planner: (datasets, topology, seed, epoch, policy) -> this rank's batches.

No I/O, no torch, no clock: the same inputs give a bitwise identical plan in every
process. Per (dataset, bucket), identically on every rank:

1. sample ids in sorted order, shuffled by a keyed pseudorandom permutation whose key
   derives from (seed, epoch, dataset, bucket, pass); with ``repeats`` r the bucket
   holds 1 + r independently shuffled passes, concatenated before anything is split.
   The permutation is evaluated only at this rank's positions (``_permute``), so a
   rank's plan costs O(samples / dp_size), not a full shuffle of every bucket;
2. a bucket smaller than one pad unit is dropped (a DroppedBucketWarning names it)
   unless ``oversubscribe`` lets the cyclic extension fill it to one whole unit;
3. ``cyclic`` extends the list by its own prefix to the next multiple of the pad unit
   (extra entries are marked as padded copies), ``drop`` truncates to the multiple,
   ``none`` leaves it uneven;
4. dp_rank d takes global positions p with p mod dp_size == d and cuts them into
   batches, so each global step is one contiguous window of the bucket's order and
   context-parallel peers get identical batches;
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

This module holds the planner itself (``plan_epoch`` and the steps-mode ``iter_steps``);
its records ``Plan`` / ``Batch`` / ``BucketStats`` and the rank's entries of step 4 live
in ``core.planrecord``, the rules of steps 2-3 and the epoch limits in ``core.policy``,
the Dataset record and its bucket order in ``core.dataset``, the schedule of step 5 in
``core.schedule``.
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Hashable, Iterator

import numpy as np

from ..errors import ConfigError, DroppedBucketWarning
from .dataset import _as_datasets
from .localbuckets import LocalBuckets
from .locality import Locality
from .permute import round_keys
from .budget import Budget
from .budgetplan import plan_buckets
from .planrecord import Batch, Bins, BucketStats, Plan, _Buckets, _rank_batches
from .policy import (
    Mode,
    PadTo,
    Policy,
    _enum,
    check_bucket_size,
    check_epoch,
    check_planned_total,
    padded_length,
    resolve_policy,
)
from .schedule import _schedule
from .seed import check_seed, derive_seed
from .topology import Topology

__all__ = ["Batch", "BucketStats", "Plan", "iter_steps", "plan_epoch"]


# wds_pad itself and the standard library: a warning's frame is never one of theirs
_LIBRARY_DIRS = (os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,
                 os.path.dirname(os.path.abspath(warnings.__file__)) + os.sep)


def user_stacklevel() -> int:
    """The ``stacklevel`` that points a warning raised by our caller at the user's line:
    the first frame outside wds_pad, webdataset, torch and the standard library."""
    import sys

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


def _check_positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ConfigError(f"{name} must be an int >= 1, got {value!r}")
    return int(value)


def plan_epoch(
    datasets: Any,
    topology: Topology,
    *,
    seed: int,
    epoch: int = 0,
    batch_size: int | Budget,
    policy: Policy | str = Policy.AUTO,
    mode: Mode | str = Mode.EPOCHS,
    oversubscribe: bool = False,
    pad_to: PadTo | str = PadTo.BATCH,
    warn: bool = True,
    locality: Locality | str = Locality.NONE,
    window: int = 8,
    accumulation_steps: int = 1,
) -> Plan:
    """Plan one epoch for this rank.

    Args:
        datasets: a Dataset, an Index (anything with ``to_dataset()``), a mapping of
            bucket key -> sample ids, or a list of those (several datasets).
        topology: this rank's Topology.
        seed: the shared seed (identical on every rank), an int in [0, 2**64).
        epoch: the epoch number, an int in [0, MAX_EPOCH].
        batch_size: samples per batch per DP rank, or a :class:`~wds_pad.core.budget.Budget`
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
            needs ``topology.local_world_size``); core/locality.py. ``shard`` and ``node``
            need an Index or a ShardMap per dataset.
        window: shards a rank (a node) visits at once with ``locality="shard"`` (``"node"``).
        accumulation_steps: K micro-batches per optimizer step: every rank's batch count
            is a multiple of K and each run of K steps reads one bucket.

    Returns:
        The Plan of ``topology.rank`` for ``epoch``.

    Raises:
        ConfigError: a wrong argument, named with the expected form.
    """
    if not isinstance(topology, Topology):
        raise ConfigError(f"topology must be a wds_pad.Topology, got {type(topology).__name__}")
    seed = check_seed(seed)
    epoch = check_epoch(epoch)
    budget = batch_size if isinstance(batch_size, Budget) else None
    bs = 1 if budget is not None else _check_positive("batch_size", batch_size)
    mode = _enum(Mode, mode, "mode")
    pad_to = _enum(PadTo, pad_to, "pad_to")
    policy = resolve_policy(policy, mode, bool(oversubscribe))
    locality = _enum(Locality, locality, "locality")
    shard_window = _check_positive("window", window)
    k = _check_accumulation(accumulation_steps, policy, pad_to, budget)
    group = topology.dp_ranks_per_node if locality is Locality.NODE else 0  # DP ranks per node
    raw = list(datasets) if isinstance(datasets, (list, tuple)) else [datasets]
    dss = _as_datasets(datasets)
    dp, d = int(topology.dp_size), int(topology.dp_rank)  # type: ignore[arg-type]
    if budget is not None:
        got = plan_buckets(raw, dss, budget=budget, policy=policy, oversubscribe=bool(oversubscribe),
                           top_up=pad_to is PadTo.BATCH, accumulation=k, seed=seed, epoch=epoch, dp=dp, d=d,
                           local=locality.dealt, window=shard_window, group=group)
        _warn_dropped(warn, got.dropped, got.dropped_samples, sum(st.samples for st in got.stats), epoch)
        table, stats, bucket_steps = got.table, got.stats, got.steps
        schedule, window_of = _schedule(dss, table, bucket_steps, seed, epoch, group=k)
        if locality.dealt:
            got.source.set_steps(int(schedule.size))
        buckets = _Buckets([], dp, d, order=got.source, local=got.source if locality.dealt else None,
                           counts=got.counts)
        bins = Bins(got.starts)
        batch_step, offsets = _rank_batches(got.counts, bucket_steps, schedule, window_of, 1, bins)
        widest = int(np.diff(bins.flat).max(initial=1)) if bins.flat.size > 1 else 1
        return Plan(
            epoch=epoch, topology=topology, batch_size=max(1, widest), policy=policy, mode=mode, pad_to=pad_to,
            oversubscribe=bool(oversubscribe), datasets=tuple(ds.name for ds in dss), bucket_table=tuple(table),
            schedule=schedule, window=window_of, batch_step=batch_step, offsets=offsets, stats=tuple(stats),
            buckets=buckets, locality=locality, shard_window=shard_window, budget=budget, bins=bins,
            accumulation=k)
    unit = pad_to.unit(dp, bs) * k

    table_: list[tuple[int, Hashable]] = []
    stats_: list[BucketStats] = []
    kept: list[tuple[np.ndarray, int, int, int, list[list[int]]]] = []  # ids, n, m, length, keys
    kept_local: list[tuple[int, Hashable, Any, int, int, int]] = []  # di, key, ids, n, passes, length
    steps_: list[int] = []
    dropped_names: list[str] = []
    dropped_samples = total_samples = 0
    planned = 0  # entries of the whole epoch over all buckets, checked before allocating
    for di, ds in enumerate(dss):
        passes = 1 + ds.repeats
        for key, ids in ds.buckets.items():
            n = int(ids.size)
            total_samples += n
            m = n * passes
            length = padded_length(m, unit, policy, bool(oversubscribe)) if n else 0
            check_bucket_size(ds.name, key, n, passes, length, dp, bs, unit, bool(oversubscribe))
            planned += length
            dropped = n > 0 and length == 0
            steps = -(-length // (dp * bs)) if length else 0
            stats_.append(BucketStats(
                dataset=ds.name, bucket=key, samples=n, repeats=ds.repeats, length=m,
                padded_length=length, padded_copies=max(length - m, 0),
                truncated=max(m - length, 0) if n else 0, dropped=dropped,
                oversubscribed=bool(n) and 0 < m < unit and length >= unit, steps=steps,
            ))
            if dropped:
                dropped_names.append(f"{ds.name}/{key!r} ({m} < pad unit {unit})")
                dropped_samples += n
            if not length:
                continue  # empty or dropped: never reaches the arithmetic below
            table_.append((di, key))
            # one keyed permutation per pass: the bucket's global order, evaluated pointwise
            keys = [round_keys(derive_seed(seed, epoch, ds.name, key, "shuffle", j)) for j in range(passes)]
            kept.append((ids, n, m, length, keys))
            kept_local.append((di, key, ids, n, passes, length))
            steps_.append(steps)
    check_planned_total(planned, epoch, str(bs), dp)
    _warn_dropped(warn, dropped_names, dropped_samples, total_samples, epoch)

    schedule, window_ = _schedule(dss, table_, steps_, seed, epoch, group=k)
    local = None
    if locality.dealt:  # the order inside each bucket; the schedule is the same
        local = LocalBuckets(raw, dss, kept_local, seed, epoch, dp, d, shard_window, schedule, bs, group)
    buckets = _Buckets(kept, dp, d, local=local)
    counts = buckets.counts
    batch_step, offsets = _rank_batches(counts, steps_, schedule, window_, bs)
    return Plan(
        epoch=epoch, topology=topology, batch_size=bs, policy=policy, mode=mode, pad_to=pad_to,
        oversubscribe=bool(oversubscribe), datasets=tuple(ds.name for ds in dss),
        bucket_table=tuple(table_), schedule=schedule, window=window_, batch_step=batch_step,
        offsets=offsets, stats=tuple(stats_), buckets=buckets, locality=locality,
        shard_window=shard_window, accumulation=k,
    )


def _check_accumulation(value: Any, policy: Policy, pad_to: PadTo, budget: Budget | None) -> int:
    k = _check_positive("accumulation_steps", value)
    if k > 1 and policy is Policy.NONE:
        raise ConfigError(
            f"accumulation_steps={k} with padding policy 'none': 'none' gives ranks different batch "
            "counts, so an epoch could not end on a whole optimizer step on every rank; use pad='cyclic' "
            "or 'drop', or accumulation_steps=1")
    if k > 1 and budget is None and pad_to is PadTo.RANK:
        raise ConfigError(
            f"accumulation_steps={k} with pad_to='rank': a bucket's last batch may then be short, so its "
            "optimizer step would mix a short micro-batch with full ones; use pad_to='batch' (a bucket "
            "padded to whole optimizer steps), or accumulation_steps=1")
    return k


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
    datasets: Any, topology: Topology, *, seed: int, batch_size: int | Budget, start_epoch: int = 0,
    policy: Policy | str = Policy.AUTO, oversubscribe: bool = False,
    pad_to: PadTo | str = PadTo.BATCH, locality: Locality | str = Locality.NONE, window: int = 8,
    accumulation_steps: int = 1,
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
                          accumulation_steps=accumulation_steps)
        if plan.steps == 0:
            raise ConfigError(
                "steps mode has nothing to stream: every bucket is smaller than one global "
                f"step ({topology.dp_size} DP ranks x batch {batch_size}); lower batch_size "
                "or pass oversubscribe=True"
            )
        yield plan
        epoch += 1
