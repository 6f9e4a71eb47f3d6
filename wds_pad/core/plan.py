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

This module holds the planner itself (``plan_epoch``, its records ``Plan`` / ``Batch`` /
``BucketStats``, the rank's entries of step 4 and the steps-mode ``iter_steps``); the
rules of steps 2-3 and the epoch limits live in ``core.policy``, the Dataset record and
its bucket order in ``core.dataset``, the schedule of step 5 in ``core.schedule``.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from typing import Any, Hashable, Iterator, Sequence

import numpy as np

from ..errors import ConfigError, DroppedBucketWarning
from .dataset import Dataset, _as_datasets, bucket_order  # noqa: F401 - also the old wds_pad.plan names
from .locality import LocalBuckets, Locality
from .permute import ROUNDS, permute, round_keys
from .policy import (  # noqa: F401 - MAX_EPOCH and resolve_policy: also the old wds_pad.plan names
    MAX_EPOCH,
    MAX_PLANNED_ENTRIES,
    Mode,
    PadTo,
    Policy,
    _check_planned_size,
    _enum,
    _padded_length,
    check_epoch,
    resolve_policy,
)
from .schedule import _schedule
from .seed import check_seed, derive_seed
from .topology import Topology

__all__ = ["Batch", "BucketStats", "Plan", "iter_steps", "plan_epoch"]


@dataclass(frozen=True)
class BucketStats:
    """What the plan did with one (dataset, bucket), identical on every rank."""

    dataset: str
    bucket: Hashable
    samples: int          # distinct samples in the bucket
    repeats: int          # configured repeats
    length: int           # samples * (1 + repeats), before padding
    padded_length: int    # global length after padding / truncation (0 if dropped)
    padded_copies: int    # entries added by cyclic padding
    truncated: int        # entries removed by drop
    dropped: bool         # the whole bucket is out of this epoch
    oversubscribed: bool  # kept below one pad unit by explicit consent
    steps: int            # global steps this bucket takes per epoch

    @property
    def effective_repeats(self) -> float:
        """Appearances per sample minus one, after padding (oversubscribed buckets > repeats)."""
        return self.padded_length / self.samples - 1 if self.samples else 0.0

    @property
    def padded_fraction(self) -> float:
        """Padded copies as a fraction of the padded length."""
        return self.padded_copies / self.padded_length if self.padded_length else 0.0


@dataclass(frozen=True)
class Batch:
    """One batch of this rank: never mixes buckets or datasets."""

    epoch: int
    step: int            # global step within the epoch (identical on every rank)
    index: int           # position in this rank's plan for the epoch
    dataset: str
    bucket: Hashable
    samples: np.ndarray  # int64 sample ids
    pad: np.ndarray      # bool: True for a padded copy

    def to_json(self, topology: Topology) -> dict[str, Any]:
        """The ``wds-pad plan --json`` record of this batch."""
        return {
            "rank": topology.rank,
            "dp_rank": topology.dp_rank,
            "step": self.step,
            "epoch": self.epoch,
            "dataset": self.dataset,
            "bucket": self.bucket,
            "samples": self.samples.tolist(),
            "pad": self.pad.tolist(),
        }


@dataclass(frozen=True, eq=False)
class Plan:
    """This rank's ordered batches for one epoch, evaluated lazily.

    ``schedule[s]`` is the bucket-table index every rank takes at global step s and
    ``window[s]`` how many earlier steps took the same bucket; ``batch_step[i]`` is the
    global step of this rank's i-th batch, which holds ``offsets[i + 1] - offsets[i]``
    entries. A batch's sample ids are computed when it is asked for (``plan[i]``), from
    the per-bucket facts kept here, so a plan costs O(buckets + steps) to set up and to
    hold, and each batch O(batch size), whatever the number of samples.
    ``samples`` / ``pad`` (every entry of the rank, in batch order) are computed on
    first use: O(the rank's share).
    """

    epoch: int
    topology: Topology
    batch_size: int
    policy: Policy
    mode: Mode
    pad_to: PadTo
    oversubscribe: bool
    datasets: tuple[str, ...]
    bucket_table: tuple[tuple[int, Hashable], ...]  # (dataset index, bucket key)
    schedule: np.ndarray
    window: np.ndarray
    batch_step: np.ndarray
    offsets: np.ndarray
    stats: tuple[BucketStats, ...] = field(repr=False)
    buckets: _Buckets = field(repr=False)
    locality: Locality = Locality.NONE
    shard_window: int = 8  # shards a rank visits at once (locality="shard")

    @property
    def steps(self) -> int:
        """Global steps in this epoch."""
        return int(self.schedule.size)

    def __len__(self) -> int:
        return int(self.batch_step.size)

    def __getitem__(self, i: int) -> Batch:
        n = len(self)
        if isinstance(i, bool) or not isinstance(i, (int, np.integer)):
            raise TypeError(f"plan indices are ints, got {type(i).__name__}")
        if not -n <= i < n:
            raise IndexError(f"batch {i} out of range for a plan of {n} batches")
        i = int(i) % n
        step = int(self.batch_step[i])
        b = int(self.schedule[step])
        ds, key = self.bucket_table[b]
        size = int(self.offsets[i + 1] - self.offsets[i])
        first = int(self.window[step]) * self.batch_size

        def batch() -> tuple[np.ndarray, np.ndarray]:
            k = np.arange(first, first + size, dtype=np.int64)
            return _entries(self.buckets, np.full(size, b, dtype=np.int64), k)

        samples, pad = _within_memory(batch, size, f"batch {i}")
        return Batch(self.epoch, step, i, self.datasets[ds], key, samples, pad)

    def __iter__(self) -> Iterator[Batch]:
        # consecutive batches in blocks of about 64K entries: one permutation pass each
        block = max(1, 65536 // max(self.batch_size, 1))
        for lo in range(0, len(self), block):
            yield from self.batches(lo, lo + block)

    def batches(self, lo: int, hi: int, step: int = 1) -> list[Batch]:
        """Batches ``range(lo, hi, step)``, equal to ``[self[i] for i in range(lo, hi, step)]``,
        computed together: one pass of the permutation for all their entries (a batch alone
        pays numpy's fixed cost per operation, several hundred microseconds). O(their entries)."""
        idx = np.arange(max(0, int(lo)), min(len(self), int(hi)), max(1, int(step)), dtype=np.int64)
        if not idx.size:
            return []
        steps = self.batch_step[idx]
        sizes = self.offsets[idx + 1] - self.offsets[idx]
        before = np.cumsum(sizes) - sizes
        total = int(sizes.sum())

        def entries() -> tuple[np.ndarray, np.ndarray]:
            b = np.repeat(self.schedule[steps], sizes)
            k = np.repeat(self.window[steps].astype(np.int64) * self.batch_size - before, sizes) + np.arange(total, dtype=np.int64)
            return _entries(self.buckets, b, k)

        samples, pad = _within_memory(entries, total, f"batches {int(idx[0])}..{int(idx[-1])}")
        out = []
        table, names, epoch = self.bucket_table, self.datasets, self.epoch
        new = object.__new__  # the fields are computed here: skip the frozen __init__'s setattr per field
        for i, st, t, at, size in zip(idx.tolist(), steps.tolist(), self.schedule[steps].tolist(), before.tolist(),
                                      sizes.tolist()):
            ds, key = table[t]
            b = new(Batch)
            b.__dict__.update(epoch=epoch, step=st, index=i, dataset=names[ds], bucket=key,
                              samples=samples[at : at + size], pad=pad[at : at + size])
            out.append(b)
        return out

    def _all(self) -> tuple[np.ndarray, np.ndarray]:
        cached = self.__dict__.get("_entries")
        if cached is None:
            def share() -> tuple[np.ndarray, np.ndarray]:
                sizes = np.diff(self.offsets)
                b = np.repeat(self.schedule[self.batch_step], sizes)
                k = (np.repeat(self.window[self.batch_step].astype(np.int64) * self.batch_size - self.offsets[:-1], sizes)
                     + np.arange(int(self.offsets[-1]), dtype=np.int64))
                return _entries(self.buckets, b, k)

            cached = _within_memory(share, int(self.offsets[-1]), "this rank's share")
            self.__dict__["_entries"] = cached
        return cached

    @property
    def samples(self) -> np.ndarray:
        """Every sample id of this rank's epoch, in batch order (batch i is
        ``samples[offsets[i]:offsets[i + 1]]``); computed on first use, O(share)."""
        return self._all()[0]

    @property
    def pad(self) -> np.ndarray:
        """The padded-copy flags parallel to :attr:`samples`."""
        return self._all()[1]


class _Buckets:
    """The kept buckets' facts a rank's entries are computed from: O(buckets).

    Entry k of kept bucket b on dp_rank d is global position p = d + k * dp_size; it
    holds pass ``(p mod m) // n`` at place ``perm_pass((p mod m) mod n)`` of the
    bucket's sorted ids, and is a padded copy iff p >= m (n samples, m = n * passes).
    """

    def __init__(self, kept: Sequence[tuple[Any, int, int, int, list[list[int]]]], dp: int, d: int) -> None:
        self.ids = [k[0] for k in kept]
        self.n = np.asarray([k[1] for k in kept], dtype=np.int64)
        self.m = np.asarray([k[2] for k in kept], dtype=np.int64)
        self.key_rows = np.asarray([row for k in kept for row in k[4]], dtype=np.uint64).reshape(-1, ROUNDS)
        self.first_row = np.zeros(len(kept), dtype=np.int64)
        np.cumsum([len(k[4]) for k in kept][:-1], out=self.first_row[1:])
        self.dp, self.d = dp, d
        self.local: LocalBuckets | None = None  # set for locality="shard"
        # entries of this rank per kept bucket
        self.counts = np.asarray([max(0, -(-(length - d) // dp)) for _, _, _, length, _ in kept], dtype=np.int64)


def _rank_batches(counts: np.ndarray, bucket_steps: Sequence[int], schedule: np.ndarray, window: np.ndarray,
                  bs: int) -> tuple[np.ndarray, np.ndarray]:
    """(batch_step, offsets) of a rank with ``counts`` entries per kept bucket: its batch for
    global step s is its entries [k*bs, (k+1)*bs) of bucket schedule[s], k = window[s]."""
    step_dtype = np.int32 if schedule.size < 2**31 else np.int64
    if np.array_equal(counts, np.asarray(bucket_steps, dtype=np.int64) * bs):
        # every bucket fills whole global steps (cyclic, drop, or lengths that happen to
        # divide): this rank has a full batch at every step; nothing per step to compute
        batch_step = np.arange(schedule.size, dtype=step_dtype)
        offsets = np.arange(schedule.size + 1, dtype=np.int64) * bs
    else:
        starts_in_bucket = window.astype(np.int64) * bs
        sizes = np.clip(counts[schedule] - starts_in_bucket, 0, bs) if schedule.size else np.zeros(0, np.int64)
        has = sizes > 0
        batch_step = np.flatnonzero(has).astype(step_dtype)
        offsets = np.zeros(batch_step.size + 1, dtype=np.int64)
        np.cumsum(sizes[has], out=offsets[1:])
    return batch_step, offsets


def _within_memory(compute: Any, entries: int, what: str) -> tuple[np.ndarray, np.ndarray]:
    """``compute()``, with a MemoryError (below the planner's limit, but more than this
    machine holds) turned into a ConfigError that says what to lower."""
    try:
        return compute()  # type: ignore[no-any-return]
    except MemoryError as exc:
        raise ConfigError(
            f"{what} holds {entries} planned entries, more than this machine can allocate "
            f"(about {entries * 64 / 2**30:.1f} GiB); lower the batch size, plan on more DP ranks, "
            "or turn oversubscribe off"
        ) from exc


def _entries(bk: _Buckets, b: np.ndarray, k: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(sample ids, padded flags) of entries ``k`` of kept buckets ``b`` (parallel arrays)."""
    if bk.local is not None:
        return bk.local.entries(b, k)
    if not k.size:
        return np.zeros(0, np.int64), np.zeros(0, bool)
    return _at(bk, b, bk.d + bk.dp * k)


def _at(bk: _Buckets, b: np.ndarray, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(sample ids, padded flags) at global positions ``pos`` of kept buckets ``b``, whatever
    the rank (the elastic remainder of an epoch reads the whole layout's order)."""
    if bk.local is not None:
        return bk.local.at(b, pos)
    if not pos.size:
        return np.zeros(0, np.int64), np.zeros(0, bool)
    m_e = bk.m[b]
    n_e = bk.n[b]
    q = pos % m_e
    pass_idx = q // n_e
    keys = bk.key_rows[bk.first_row[b] + pass_idx].T
    perm = permute(q % n_e, n_e, keys)
    samples = np.empty(pos.size, dtype=np.int64)
    if np.all(b == b[0]):  # one batch: one bucket
        samples[:] = bk.ids[int(b[0])][perm]
    else:
        order = np.argsort(b, kind="stable")
        bounds = np.searchsorted(b[order], np.arange(len(bk.ids) + 1))
        for j, ids in enumerate(bk.ids):
            lo, hi = int(bounds[j]), int(bounds[j + 1])
            if hi > lo:
                sel = order[lo:hi]
                samples[sel] = ids[perm[sel]]
    return samples, pos >= m_e


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
    batch_size: int,
    policy: Policy | str = Policy.AUTO,
    mode: Mode | str = Mode.EPOCHS,
    oversubscribe: bool = False,
    pad_to: PadTo | str = PadTo.BATCH,
    warn: bool = True,
    locality: Locality | str = Locality.NONE,
    window: int = 8,
) -> Plan:
    """Plan one epoch for this rank.

    Args:
        datasets: a Dataset, an Index (anything with ``to_dataset()``), a mapping of
            bucket key -> sample ids, or a list of those (several datasets).
        topology: this rank's Topology.
        seed: the shared seed (identical on every rank), an int in [0, 2**64).
        epoch: the epoch number, an int in [0, MAX_EPOCH].
        batch_size: samples per batch per DP rank.
        policy: ``auto`` | ``cyclic`` | ``drop`` | ``none``.
        mode: ``epochs`` | ``steps`` (only matters for ``auto``).
        oversubscribe: keep buckets smaller than one pad unit, filled cyclically.
        pad_to: ``batch`` (unit dp_size * batch_size) or ``rank`` (unit dp_size).
        warn: emit a DroppedBucketWarning naming each dropped bucket.
        locality: ``none`` (every bucket shuffled across all shards) or ``shard`` (each
            rank reads its own shards, dealt per epoch, through a window of shards;
            core/locality.py). ``shard`` needs an Index or a ShardMap per dataset.
        window: shards a rank visits at once with ``locality="shard"`` (int >= 1).

    Returns:
        The Plan of ``topology.rank`` for ``epoch``.

    Raises:
        ConfigError: a wrong argument, named with the expected form.
    """
    if not isinstance(topology, Topology):
        raise ConfigError(f"topology must be a wds_pad.Topology, got {type(topology).__name__}")
    seed = check_seed(seed)
    epoch = check_epoch(epoch)
    bs = _check_positive("batch_size", batch_size)
    mode = _enum(Mode, mode, "mode")
    pad_to = _enum(PadTo, pad_to, "pad_to")
    policy = resolve_policy(policy, mode, bool(oversubscribe))
    locality = _enum(Locality, locality, "locality")
    shard_window = _check_positive("window", window)
    raw = list(datasets) if isinstance(datasets, (list, tuple)) else [datasets]
    dss = _as_datasets(datasets)
    dp, d = int(topology.dp_size), int(topology.dp_rank)  # type: ignore[arg-type]
    unit = pad_to.unit(dp, bs)

    table: list[tuple[int, Hashable]] = []
    stats: list[BucketStats] = []
    kept: list[tuple[np.ndarray, int, int, int, list[list[int]]]] = []  # ids, n, m, length, keys
    kept_local: list[tuple[int, Hashable, Any, int, int, int]] = []  # di, key, ids, n, passes, length
    bucket_steps: list[int] = []
    dropped_names: list[str] = []
    dropped_samples = total_samples = 0
    planned = 0  # entries of the whole epoch over all buckets, checked before allocating
    for di, ds in enumerate(dss):
        passes = 1 + ds.repeats
        for key, ids in ds.buckets.items():
            n = int(ids.size)
            total_samples += n
            m = n * passes
            length = _padded_length(m, unit, policy, bool(oversubscribe)) if n else 0
            _check_planned_size(ds.name, key, n, passes, length, dp, bs, unit, bool(oversubscribe))
            planned += length
            dropped = n > 0 and length == 0
            steps = -(-length // (dp * bs)) if length else 0
            stats.append(BucketStats(
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
            table.append((di, key))
            # one keyed permutation per pass: the bucket's global order, evaluated pointwise
            keys = [round_keys(derive_seed(seed, epoch, ds.name, key, "shuffle", j)) for j in range(passes)]
            kept.append((ids, n, m, length, keys))
            kept_local.append((di, key, ids, n, passes, length))
            bucket_steps.append(steps)
    if planned > MAX_PLANNED_ENTRIES:
        raise ConfigError(
            f"epoch {epoch} would plan {planned} entries over all buckets and datasets, above the "
            f"planner's limit of MAX_PLANNED_ENTRIES = 2**40 = {MAX_PLANNED_ENTRIES}; lower repeats, "
            f"the batch size ({bs}) or the world size ({dp} DP ranks), or turn oversubscribe off"
        )
    buckets = _Buckets(kept, dp, d)
    counts = buckets.counts
    if warn and dropped_names:
        warnings.warn(
            f"{len(dropped_names)} bucket(s) smaller than one global step were dropped from "
            f"epoch {epoch}: {', '.join(dropped_names[:10])}{' ...' if len(dropped_names) > 10 else ''}; "
            f"they hold {dropped_samples} of the epoch's {total_samples} samples "
            f"({100 * dropped_samples / max(total_samples, 1):.1f}%), which this epoch does not train on. "
            "Pass oversubscribe=True (--oversubscribe) to keep them: each is then filled cyclically "
            "to one global step, so its samples appear more often than the others'",
            DroppedBucketWarning,
            stacklevel=user_stacklevel(),
        )

    schedule, window = _schedule(dss, table, bucket_steps, seed, epoch)
    if locality is Locality.SHARD:  # the order inside each bucket; the schedule is the same
        buckets.local = LocalBuckets(raw, dss, kept_local, seed, epoch, dp, d, shard_window, schedule, bs)
    batch_step, offsets = _rank_batches(counts, bucket_steps, schedule, window, bs)
    return Plan(
        epoch=epoch, topology=topology, batch_size=bs, policy=policy, mode=mode, pad_to=pad_to,
        oversubscribe=bool(oversubscribe), datasets=tuple(ds.name for ds in dss),
        bucket_table=tuple(table), schedule=schedule, window=window, batch_step=batch_step,
        offsets=offsets, stats=tuple(stats), buckets=buckets, locality=locality,
        shard_window=shard_window,
    )


def iter_steps(
    datasets: Any, topology: Topology, *, seed: int, batch_size: int, start_epoch: int = 0,
    policy: Policy | str = Policy.AUTO, oversubscribe: bool = False,
    pad_to: PadTo | str = PadTo.BATCH, locality: Locality | str = Locality.NONE, window: int = 8,
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
                          pad_to=pad_to, warn=epoch == start_epoch, locality=locality, window=window)
        if plan.steps == 0:
            raise ConfigError(
                "steps mode has nothing to stream: every bucket is smaller than one global "
                f"step ({topology.dp_size} DP ranks x batch {batch_size}); lower batch_size "
                "or pass oversubscribe=True"
            )
        yield plan
        epoch += 1
