"""The epoch schedule: which (dataset, bucket) every rank takes at each global step.

A pure function of (datasets, bucket table, steps per bucket, seed, epoch): no rank,
no sample ids, so every rank computes the same schedule (invariant 1). Invariants:

- the schedule holds bucket-table index b exactly ``steps[b]`` times, and window k of a
  bucket (its k-th step) comes after its window k - 1: each bucket's windows in order;
- within one dataset the steps are shuffled by an RNG derived from (seed, epoch,
  dataset name); several datasets are merged as competing Poisson processes whose rates
  are their weights, drawn from an RNG derived from (seed, epoch) alone;
- the result is int64 and identical under any PYTHONHASHSEED (invariant 4).
"""

from __future__ import annotations

from typing import Hashable, Sequence

import numpy as np

from .dataset import Dataset
from .seed import derive_rng


def _schedule(
    dss: Sequence[Dataset], table: Sequence[tuple[int, Hashable]], steps: Sequence[int],
    seed: int, epoch: int,
) -> tuple[np.ndarray, np.ndarray]:
    """Global step -> (bucket-table index, window number within that bucket)."""
    steps_arr = np.asarray(steps, dtype=np.int64)
    table_ds = np.asarray([di for di, _ in table], dtype=np.int64)
    per_ds: list[np.ndarray] = []
    for di, ds in enumerate(dss):
        mine = np.flatnonzero(table_ds == di) if table_ds.size else np.zeros(0, np.int64)
        seq = np.repeat(mine, steps_arr[mine]) if mine.size else np.zeros(0, np.int64)
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
    schedule = schedule.astype(np.int64, copy=False)
    # window k of a bucket = how many earlier steps took the same bucket
    order = np.argsort(schedule, kind="stable")
    sorted_b = schedule[order]
    first = np.searchsorted(sorted_b, sorted_b, side="left")
    window = np.empty_like(schedule)
    window[order] = np.arange(schedule.size, dtype=np.int64) - first
    return schedule, window
