"""Elastic resumption: what is left of an epoch when it resumes on another DP layout.

The planner is pure, so the plan of every earlier layout can be recomputed. Global step
k of a bucket is the contiguous window [k*W, (k+1)*W) of the bucket's padded order
(W = dp_size * batch_size), and that padded order is the same on every layout (the
shuffle derives from (seed, epoch, dataset, bucket), padding extends it by its own
prefix). So what a run consumed of each bucket is a prefix of it.

Invariants:
- a view is exact or refused: it keeps this rank's batches of the windows not yet
  consumed, in the current schedule's order; if a consumed prefix is not a whole number
  of the current layout's windows (or the whole bucket), TopologyMismatchError names the
  bucket and both sizes;
- the union over DP ranks of the consumed batches and the view's batches is exactly the
  current layout's epoch;
- pure numpy over the plans' schedules: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Hashable, Mapping, Sequence

import numpy as np

from ..errors import StateMismatchError, TopologyMismatchError
from ..core.plan import Plan

__all__ = ["ElasticView", "elastic_view"]


@dataclass(frozen=True, eq=False)
class ElasticView:
    """An epoch resumed on another layout: what is left of it on this rank.

    Attributes:
        epoch: the epoch this view belongs to (later epochs are planned normally).
        segments: ``(dp_size, steps)`` of each earlier layout that consumed part of the
            epoch, in order; saved in the state so a later resume recomputes ``keep``.
        keep: this rank's plan indices still to stream, ascending (the new schedule's order).
    """

    epoch: int
    segments: tuple[tuple[int, int], ...]
    keep: np.ndarray

    def to_json(self) -> dict[str, Any]:
        return {"segments": [[d, s] for d, s in self.segments]}


def _skips(plan: Plan, prefix: Mapping[tuple[int, Hashable], int]) -> np.ndarray:
    """Windows of each of ``plan``'s buckets covered by the consumed prefixes (exactly)."""
    dp, bs = int(plan.topology.dp_size), plan.batch_size  # type: ignore[arg-type]
    width = dp * bs
    lengths = {(s.dataset, s.bucket): s.padded_length for s in plan.stats}
    slot = {entry: t for t, entry in enumerate(plan.bucket_table)}
    skip = np.zeros(len(plan.bucket_table), dtype=np.int64)
    for (di, key), consumed in prefix.items():
        if consumed == 0:
            continue
        where = f"bucket {key!r} of dataset {plan.datasets[di]!r}"
        length = lengths.get((plan.datasets[di], key), 0)
        t = slot.get((di, key))
        if t is None or consumed > length:
            raise TopologyMismatchError(
                f"allow_elastic: {consumed} samples of {where} were consumed, but on dp_size {dp} the "
                f"epoch holds only {length} of them (padding or dropping differs); the position "
                "does not map exactly. Resume on the saved layout, or from an epoch boundary")
        if consumed == length:
            skip[t] = -(-length // width)
        elif consumed % width:
            raise TopologyMismatchError(
                f"allow_elastic: {consumed} samples of {where} were consumed, not a multiple of one "
                f"global step on dp_size {dp} ({dp} x batch_size {bs} = {width}); the position "
                "does not map exactly. Resume on the saved layout, on a dp_size whose global step "
                "divides the consumed prefix, or from an epoch boundary")
        else:
            skip[t] = consumed // width
    return skip


def elastic_view(plan_for: Callable[[int], Plan], epoch: int, segments: Sequence[tuple[int, int]],
                 current: Plan) -> ElasticView:
    """What is left of ``epoch`` on the current layout after earlier layouts consumed a part.

    The planner is pure, so each earlier layout's plan is recomputed (``plan_for(dp_size)``
    plans ``epoch`` on that many DP ranks). Global step k of a bucket is the contiguous
    window [k*W, (k+1)*W) of the bucket's padded order (W = dp_size * batch_size), and the
    padded order is the same on every layout; so the consumed part of each bucket is a
    prefix. It maps onto the current layout iff every prefix is a whole number of its
    windows (or the whole bucket); the view then keeps this rank's batches of the
    remaining windows, in the current schedule's order.

    Raises:
        TopologyMismatchError: a prefix does not map exactly, naming the bucket.
        StateMismatchError: a segment consumed more steps than its layout's epoch has.
    """
    prefix: dict[tuple[int, Hashable], int] = {}
    for dp, steps in segments:
        plan = plan_for(dp)
        window, sched = plan.window, plan.schedule
        skip = _skips(plan, prefix)
        left = np.flatnonzero(window >= skip[sched]) if sched.size else sched
        if steps > left.size:
            raise StateMismatchError(f"loader state position {steps} is past the end of epoch {epoch} "
                                     f"on dp_size {dp} ({left.size} steps left); the state does not "
                                     "belong to this plan")
        taken = np.bincount(sched[left[:steps]], minlength=len(plan.bucket_table))
        width = dp * plan.batch_size
        lengths = {(s.dataset, s.bucket): s.padded_length for s in plan.stats}
        for t, (di, key) in enumerate(plan.bucket_table):
            done = int(skip[t] + taken[t]) * width
            prefix[(di, key)] = min(done, lengths[(plan.datasets[di], key)])
    window = current.window
    skip = _skips(current, prefix)
    steps = current.batch_step
    keep = np.flatnonzero(window[steps] >= skip[current.schedule[steps]]) if steps.size else steps
    return ElasticView(epoch=epoch, segments=tuple(segments), keep=keep.astype(np.int64))
