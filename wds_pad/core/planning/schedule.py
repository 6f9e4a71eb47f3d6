"""The epoch schedule: which (dataset, bucket) every rank takes at each global step.

A pure function of (datasets, bucket table, steps per bucket, seed, epoch): no rank,
no sample ids, so every rank computes the same schedule (invariant 1). Invariants:

- the schedule holds bucket-table index b exactly ``steps[b]`` times, and window k of a
  bucket (its k-th step) comes after its window k - 1: each bucket's windows in order;
- within one dataset the steps are shuffled by an RNG derived from (seed, epoch,
  dataset name); several datasets are merged as competing Poisson processes whose rates
  are their weights, drawn from an RNG derived from (seed, epoch) alone;
- with gradient accumulation (``accumulation_steps`` K) the schedule is that of the buckets' K-step
  groups with each group's step repeated K times: K consecutive steps, one bucket;
- the result is identical under any PYTHONHASHSEED (invariant 4); it is stored as narrow
  as its values allow (int16 bucket indices below 2**15 buckets, int32 windows), because
  it is O(steps) and a rank of a large job holds millions of steps. Its values do not
  depend on the width: the permutation draws the same swaps for any integer dtype.
"""

from __future__ import annotations

from typing import Hashable, Sequence

import numpy as np

from ..dataset import Dataset
from ..seed import derive_rng


def step_schedule(
    dss: Sequence[Dataset], table: Sequence[tuple[int, Hashable]], steps: Sequence[int],
    seed: int, epoch: int, accumulation_steps: int = 1,
) -> tuple[np.ndarray, np.ndarray]:
    """Global step -> (bucket-table index, window number within that bucket), as narrow
    integer arrays (see the module's invariants). With ``accumulation_steps`` K > 1 every bucket's
    steps (a multiple of K) are scheduled K at a time: the K micro-batches of one
    optimizer step (gradient accumulation) come from one bucket."""
    if accumulation_steps > 1:
        groups = [int(s) // accumulation_steps for s in steps]
        schedule, _ = step_schedule(dss, table, groups, seed, epoch)
        schedule = np.repeat(schedule, accumulation_steps)
        return schedule, _windows(schedule, len(table))
    steps_arr = np.asarray(steps, dtype=np.int64)
    table_ds = np.asarray([di for di, _ in table], dtype=np.int64)
    dt = _index_dtype(len(table))
    per_ds: list[np.ndarray] = []
    for di, ds in enumerate(dss):
        mine = (np.flatnonzero(table_ds == di) if table_ds.size else np.zeros(0, np.int64)).astype(dt)
        seq = np.repeat(mine, steps_arr[mine]) if mine.size else np.zeros(0, dt)
        per_ds.append(derive_rng(seed, epoch, ds.name, "schedule").permutation(seq))
    if len(per_ds) == 1:
        schedule = per_ds[0]
    else:
        # Competing Poisson processes with rates = weights: while datasets have steps
        # left, the next step comes from dataset i with probability w_i / sum(w_active).
        rng = derive_rng(seed, epoch, "datasets")
        times = [np.cumsum(rng.exponential(1.0 / ds.weight, size=seq.size)) for ds, seq in zip(dss, per_ds)]
        order = np.argsort(np.concatenate(times), kind="stable")
        schedule = np.concatenate(per_ds)[order]
    schedule = schedule.astype(dt, copy=False)
    return schedule, _windows(schedule, len(table))


def _windows(schedule: np.ndarray, buckets: int, chunk: int = 1 << 20) -> np.ndarray:
    """Window k of a bucket = how many earlier steps took the same bucket.

    Per chunk of steps: the rank of each step among the chunk's steps of its bucket (a
    stable sort: radix for int16) plus the bucket's steps in earlier chunks. Chunked so
    that the transient index arrays stay a few MB whatever the number of steps.
    """
    window = np.empty(schedule.size, dtype=np.int32 if schedule.size < 2**31 else np.int64)
    seen = np.zeros(buckets, dtype=np.int64)
    for lo in range(0, schedule.size, chunk):
        part = schedule[lo : lo + chunk]
        order = np.argsort(part, kind="stable")
        counts = np.bincount(part, minlength=buckets)
        run_start = np.cumsum(counts) - counts
        window[lo + order] = np.arange(part.size, dtype=np.int64) - np.repeat(run_start - seen, counts)
        seen += counts
    return window


def _index_dtype(n: int) -> np.dtype:
    """The narrowest signed dtype for indices into a table of ``n`` entries."""
    return np.dtype(np.int16 if n <= 2**15 else np.int32 if n <= 2**31 else np.int64)
