"""A pure-Python (lists and loops) reference planner: the test oracle and the benchmark peer.

It implements the semantics of :func:`wds_pad.core.planning.plan.plan_epoch` the obvious way, one
sample at a time, so that tests can check the vectorised planner against it and the
benchmark can measure what vectorisation buys. To make outputs comparable it draws its
random numbers exactly like the real planner: the shuffles use the same keyed
permutation (``permute_one``, the scalar reference of the planner's vectorised one)
with the same keys, the schedule comes from the same ``derive_rng(...)`` streams, and
buckets are visited in the same canonical
order (``bucket_order``). Everything else — padding, the split over DP ranks, batching,
the walk over the schedule, the statistics — is written out independently here.

Semantics, per (dataset, bucket), identically on every rank:

1. ``order`` = 1 + repeats independently shuffled passes over the sorted ids, built in
   full, then padded in full, then sliced for this rank — the straightforward way;
2. the pad unit is ``dp_size * batch_size`` (``pad_to="batch"``) or ``dp_size``
   (``pad_to="rank"``); ``cyclic`` extends ``order`` by its own prefix to the next
   multiple of the unit, ``drop`` truncates, ``none`` leaves it; a bucket shorter than
   one unit is dropped, unless ``none``, or ``cyclic`` with ``oversubscribe`` (then it
   is filled cyclically to exactly one unit);
3. dp_rank d takes global positions d, d + dp, d + 2 dp, ... and cuts them into
   batches of ``batch_size``;
4. the schedule lists each kept bucket ``ceil(length / (dp * bs))`` times, shuffled
   per dataset; several datasets are merged as competing Poisson processes.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Hashable, Mapping

from wds_pad.core.dataset import bucket_order
from wds_pad.core.permute import permute_one
from wds_pad.core.seed import derive_rng, derive_seed

__all__ = ["ListDataset", "ListPlan", "plan_epoch_lists"]


@dataclass
class ListDataset:
    """A dataset as plain lists: bucket key -> list of int sample ids (any order)."""

    name: str
    buckets: Mapping[Hashable, list[int]]
    repeats: int = 0
    weight: float = 1.0


@dataclass
class ListPlan:
    """One rank's epoch: batches as (step, dataset, bucket, samples, pad) tuples."""

    steps: int
    batches: list[tuple[int, str, Hashable, list[int], list[bool]]]
    stats: list[dict[str, Any]] = field(default_factory=list)


def _resolve(policy: str, mode: str, oversubscribe: bool) -> str:
    if policy == "auto":
        return "cyclic" if mode == "epochs" or oversubscribe else "drop"
    return policy


def plan_epoch_lists(
    datasets: list[ListDataset],
    *,
    world_size: int,
    rank: int,
    cp_size: int = 1,
    seed: int,
    epoch: int = 0,
    batch_size: int,
    policy: str = "auto",
    mode: str = "epochs",
    oversubscribe: bool = False,
    pad_to: str = "batch",
) -> ListPlan:
    """Plan one epoch for ``rank`` with lists and loops (see the module docstring)."""
    dp = world_size // cp_size
    d = rank // cp_size
    bs = batch_size
    policy = _resolve(policy, mode, oversubscribe)
    unit = dp * bs if pad_to == "batch" else dp

    table: list[tuple[int, Hashable]] = []
    rank_lists: list[list[tuple[int, bool]]] = []
    table_steps: list[int] = []
    stats: list[dict[str, Any]] = []
    for di, ds in enumerate(datasets):
        for key in sorted(ds.buckets, key=bucket_order):
            ids = sorted(int(i) for i in ds.buckets[key])
            n = len(ids)
            m = n * (1 + ds.repeats)
            if n == 0:
                length = 0
            elif policy == "none":
                length = m
            elif m < unit:
                length = unit if policy == "cyclic" and oversubscribe else 0
            elif policy == "cyclic":
                length = m if m % unit == 0 else (m // unit + 1) * unit
            else:
                length = (m // unit) * unit
            global_step = dp * bs
            steps = 0
            if length:
                steps = length // global_step + (1 if length % global_step else 0)
            stats.append({
                "dataset": ds.name, "bucket": key, "samples": n, "length": m,
                "padded_length": length, "padded_copies": max(length - m, 0),
                "truncated": max(m - length, 0) if n else 0,
                "dropped": n > 0 and length == 0,
                "oversubscribed": n > 0 and m < unit and length >= unit,
                "steps": steps,
            })
            if length == 0:
                continue
            order: list[int] = []
            for j in range(1 + ds.repeats):
                pkey = derive_seed(seed, epoch, ds.name, key, "shuffle", j)
                order.extend(ids[permute_one(i, n, pkey)] for i in range(n))
            # the padded list: position i is order[i % m], a padded copy if i >= m
            padded = [(order[i % m], i >= m) for i in range(length)]
            table.append((di, key))
            rank_lists.append(padded[d::dp])  # this rank's share: positions d, d + dp, ...
            table_steps.append(steps)

    schedule = _schedule(datasets, table, table_steps, seed, epoch)
    taken = [0] * len(table)
    batches: list[tuple[int, str, Hashable, list[int], list[bool]]] = []
    for step, t in enumerate(schedule):
        k = taken[t]
        taken[t] += 1
        chunk = rank_lists[t][k * bs : (k + 1) * bs]
        if chunk:
            di, key = table[t]
            batches.append((step, datasets[di].name, key,
                            [s for s, _ in chunk], [p for _, p in chunk]))
    return ListPlan(steps=len(schedule), batches=batches, stats=stats)


def _schedule(
    datasets: list[ListDataset], table: list[tuple[int, Hashable]], steps: list[int],
    seed: int, epoch: int,
) -> list[int]:
    per_ds: list[list[int]] = []
    for di, ds in enumerate(datasets):
        seq: list[int] = []
        for t, (tdi, _) in enumerate(table):
            if tdi == di:
                seq.extend([t] * steps[t])
        perm = derive_rng(seed, epoch, ds.name, "schedule").permutation(len(seq)).tolist()
        per_ds.append([seq[i] for i in perm])
    if len(per_ds) == 1:
        return per_ds[0]
    rng = derive_rng(seed, epoch, "datasets")
    times: list[float] = []
    merged: list[int] = []
    for ds, seq in zip(datasets, per_ds):
        gaps = rng.exponential(1.0 / ds.weight, size=len(seq)).tolist()
        times.extend(itertools.accumulate(gaps))
        merged.extend(seq)
    by_time = sorted(range(len(merged)), key=lambda i: times[i])  # stable: ties keep order
    return [merged[i] for i in by_time]
