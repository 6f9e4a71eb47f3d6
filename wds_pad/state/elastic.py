"""Elastic resumption: an epoch resumed on another DP layout, at any step.

The planner is pure, so the plan of every earlier layout can be recomputed: from the
saved layouts and positions (``segments``) core/elastic/remainder.py knows exactly which entries
of the epoch were consumed, and plans what remains on the current layout: every entry
not yet trained on, exactly once, cyclically padded per bucket to the new pad unit, in
lockstep on the new ranks (for ``locality="shard"`` dealt to them by old ranks' shards).

Invariants:
- a view is exact or refused: what every earlier segment's ranks consumed plus the
  view's real entries over every current DP rank is the epoch, each entry once;
  a refusal (a position past its layout's end, a malformed segment) names the field;
- the view's fingerprint (a digest of the segments and the remainder's buckets and
  schedule, equal on every rank) is saved as the last segment's third field; a saved one
  that differs from the recomputed one is refused;
- pure: no I/O; a view pickles without its plan (recomputed where it is used).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Sequence

import numpy as np

from ..core.planning.plan import Plan
from ..core.elastic.remainder import Remainder, Segment, plan_remainder
from .spec import PlanSpec

__all__ = ["ElasticView", "Segment", "elastic_view"]


@dataclass(frozen=True, eq=False)
class ElasticView:
    """An epoch resumed on another layout: what is left of it on this rank.

    Attributes:
        epoch: the epoch this view belongs to (later epochs are planned normally).
        segments: each earlier layout that consumed part of the epoch, with how far its
            ranks got, in order; saved in the state so a later resume recomputes the view.
        spec: the PlanSpec the rest of the epoch is planned with (its topology: this layout).
    """

    epoch: int
    segments: tuple[Segment, ...]
    spec: PlanSpec

    def _remainder(self) -> Remainder:
        cached = self.__dict__.get("_cached")
        if cached is None:
            s = self.spec
            cached = plan_remainder(s.datasets(), s.topology, self.segments, epoch=self.epoch, **s.plan_kwargs())
            self.__dict__["_cached"] = cached
        return cached

    @property
    def plan(self) -> Plan:
        """This rank's plan of the rest of the epoch (batches indexed from 0)."""
        return self._remainder().plan

    @property
    def fingerprint(self) -> str:
        """The remainder's fingerprint: equal on every rank of the current layout."""
        return self._remainder().fingerprint

    @property
    def keep(self) -> np.ndarray:
        """The view's batch indices (all of its plan's)."""
        return np.arange(len(self.plan), dtype=np.int64)

    def to_json(self) -> dict[str, Any]:
        """``{"segments": [[dp_size, steps, fingerprint], ...]}``: the last segment carries this
        view's fingerprint (a field inside ``segments``, so the state's keys are the same with
        or without a view, as torch.distributed.checkpoint's load template needs)."""
        *earlier, last = self.segments
        return {"segments": [s.to_json() for s in earlier] + [replace(last, fingerprint=self.fingerprint).to_json()]}

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "_cached"}


def elastic_view(spec: PlanSpec, epoch: int, segments: Sequence[Segment]) -> ElasticView:
    """What is left of ``epoch`` on ``spec``'s layout after ``segments``; planned now, so a
    refusal comes before anything is restored.

    Raises:
        StateMismatchError: a segment goes past the end of what its layout had.
        StateError: a malformed segment.
    """
    view = ElasticView(int(epoch), tuple(segments), spec)
    view.plan  # noqa: B018 - plans (and refuses) now
    return view
