"""Where a loader is in its plan: one frozen ``Cursor`` record, held by both dataset kinds.

``BucketedWebDataset`` holds its place as a cursor (epoch, batch index, the elastic view of
a resumed epoch, the DataLoader worker a position belongs to, whether it is pinned);
``ShardStream`` holds its epoch and, as ``shards``, each worker's place in its shards.
Loaders move a dataset by handing it a new cursor (``dataset.seek(cursor)``); ``restore``
(state/verify.py) turns a verified state into one.

Invariants:
- a cursor is a seek into the plan: the next batch is ``plan(epoch)[index]``, counted in
  the elastic view's plan when ``view`` covers ``epoch``; resuming there reads no
  earlier batch;
- frozen: every move makes a new cursor, so a cursor handed to a worker or saved in a
  state never changes under it;
- ``pinned``: the next iteration starts exactly here (a restored state, or the start a
  Loader decided for its workers), even at the end of an epoch, where it then yields
  nothing; unpinned, "a finished epoch iterates again from its start" —
  :meth:`Cursor.rewound` (:meth:`ShardProgress.rewound` on the shard-level path), the
  one place that rule is written for each;
- ``worker``: (id, num_workers) of the DataLoader worker whose own next batch this is
  (it then takes every num_workers-th batch from here), None in the main process;
- ``epoch`` and ``index`` are ints >= 0, the epoch at most MAX_EPOCH (a ConfigError
  otherwise); a shard-level position's fields are ints >= 0 (a StateError otherwise).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..core.policy import MAX_EPOCH, Mode
from ..errors import ConfigError, StateError
from .elastic import ElasticView
from .spec import PlanSpec

__all__ = ["Cursor", "Position", "ShardProgress", "WorkerPosition", "epoch_length"]


def epoch_length(spec: PlanSpec, epoch: int, view: ElasticView | None) -> int:
    """Batches of ``epoch`` on this rank, in the elastic view if it covers that epoch."""
    return len(view.plan) if view is not None and view.epoch == epoch else len(spec.plan(epoch))


@dataclass(frozen=True)
class WorkerPosition:
    """Where one DataLoader worker of the shard-level path stands: the position of its
    shard in its plan, the byte offset of its next sample there, the samples it yielded."""

    shard: int = 0
    offset: int = 0
    yielded: int = 0

    def __post_init__(self) -> None:
        for name in ("shard", "offset", "yielded"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise StateError(f"shard-stream position field {name!r} must be an int >= 0, got {v!r}")


@dataclass(frozen=True)
class ShardProgress:
    """A rank's place in an epoch of the shard-level path: each worker's position (empty:
    at the start), the worker the DataLoader's round-robin asks next, whether it is done."""

    positions: tuple[WorkerPosition, ...] = ()
    next_worker: int = 0
    done: bool = False

    @property
    def yielded(self) -> int:
        """Samples the rank yielded in the epoch (over every worker)."""
        return sum(p.yielded for p in self.positions)

    def rewound(self) -> ShardProgress:
        """Where an iteration from here starts: a finished epoch again from its start."""
        return ShardProgress() if self.done else self


@dataclass(frozen=True)
class Cursor:
    """Where a stream is: the next batch is ``plan(epoch)[index]`` (see the module docstring).

    ``Cursor(epoch, index)`` is all a fresh position needs (``wds_pad.Position`` is this
    class); ``view``, ``worker``, ``pinned`` and ``shards`` are what a loader adds.
    """

    epoch: int = 0
    index: int = 0
    view: ElasticView | None = None
    worker: tuple[int, int] | None = None
    pinned: bool = False
    shards: ShardProgress = ShardProgress()

    def __post_init__(self) -> None:
        for name in ("epoch", "index"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ConfigError(f"Cursor.{name} must be an int >= 0, got {v!r}")
        if self.epoch > MAX_EPOCH:
            raise ConfigError(f"Cursor.epoch must be at most MAX_EPOCH={MAX_EPOCH}, got {self.epoch}")

    def at(self, epoch: int, index: int) -> Cursor:
        """This cursor at batch ``index`` of ``epoch``, everything else kept (once per batch:
        no checks, the planner's own counts only)."""
        moved = object.__new__(Cursor)
        moved.__dict__.update(self.__dict__)
        moved.__dict__["epoch"], moved.__dict__["index"] = epoch, index
        return moved

    def with_shards(self, shards: ShardProgress) -> Cursor:
        """This cursor with the shard-level place ``shards``, everything else kept (once per
        item the shard-level path yields: no checks)."""
        moved = object.__new__(Cursor)
        moved.__dict__.update(self.__dict__)
        moved.__dict__["shards"] = shards
        return moved

    def length(self, spec: PlanSpec) -> int:
        """Batches of this cursor's epoch on this rank (in the view, if it covers it)."""
        return epoch_length(spec, self.epoch, self.view)

    def rewound(self, spec: PlanSpec) -> Cursor:
        """Where an iteration from here starts: a finished epoch (epochs mode, not pinned)
        iterates again from its start, on this layout (without the elastic view); any
        other cursor starts where it is."""
        if self.pinned or spec.mode is not Mode.EPOCHS or self.index < self.length(spec):
            return self
        return replace(self, index=0, view=None)

    def forward(self, spec: PlanSpec, n: int) -> Cursor:
        """This cursor moved on by ``n`` batches: across epochs in steps mode, at most to
        the end of the epoch in epochs mode."""
        epoch, index = self.epoch, self.index + n
        while spec.mode is Mode.STEPS:
            length = epoch_length(spec, epoch, self.view)
            if index < length or (length == 0 and len(spec.plan(epoch)) == 0):
                break
            epoch, index = epoch + 1, index - length
        if spec.mode is Mode.EPOCHS:
            index = min(index, epoch_length(spec, epoch, self.view))
        return self.at(epoch, index)


#: A fresh position in the plan, ``Position(epoch, index)``: the name the raw stages use.
Position = Cursor
