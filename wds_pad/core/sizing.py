"""How batches are sized: a sample count (:class:`Count`) or a cost budget (:class:`Budget`).

The planner composes a sizing with an entry order (core/planning/planrecord.py's ``EntryOrder``):
the sizing owns the pad unit a bucket is padded to, whether a bucket's last batch may be
short, how it names itself in messages and in the plan's fingerprint, and which bucket
cut measures its buckets and cuts their order into batches (``kind``, a name
core/planning/plan.py looks up in ``BUCKET_CUTS``, as Mosaic Streaming looks up a shuffle). ``plan_epoch(batch_size=...)`` takes an int or a
Budget; :func:`as_sizing` turns it into a sizing, once.

Invariants:
- a sizing is valid once built (a Count's batch size an int >= 1, a Budget's fields
  checked by Budget); anything else is one ConfigError naming ``batch_size``;
- the pad unit is one rule per sizing, :meth:`Count.pad_unit` / ``Budget.pad_unit``:
  every bucket's padded length is a multiple of it (``policy="none"`` aside).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from .budgets.budget import Budget
from .budgets.packing import Pack
from .policy import PadTo, check_positive

__all__ = ["Count", "Sizing", "as_sizing"]


class Sizing(Protocol):
    """What the planner asks of a sizing (:class:`Count`, :class:`~wds_pad.core.budgets.budget.Budget`)."""

    kind: ClassVar[str]          # its bucket cut (core/planning/plan.py BUCKET_CUTS)
    needs_costs: ClassVar[bool]  # every dataset must give each sample's cost

    def pad_unit(self, dp_size: int, pad_to: PadTo, accumulation_steps: int) -> int:
        """What every bucket's padded length is a multiple of."""

    def short_last_batch(self, pad_to: PadTo) -> bool:
        """Whether a bucket's last batch may hold fewer samples than the others."""

    def describe(self) -> str:
        """How messages name it: ``64``, ``budget 8192``, ``pack 8192 x 4``."""

    def summary(self) -> str:
        """How ``plan --summary`` and ``batched()`` name it: ``batch 64``, ``budget 8192 (sum)``."""

    def fingerprint(self) -> Any:
        """The plan fingerprint's ``batch_size`` field (and ``to_json()``, where it has one,
        what ``wds-pad plan --json`` records)."""


@dataclass(frozen=True)
class Count:
    """Batches of ``batch_size`` samples per DP rank (a bucket's last may be shorter
    with ``pad_to="rank"`` or ``policy="none"``).

    Raises:
        ConfigError: ``batch_size`` is not an int >= 1.
    """

    batch_size: int
    kind: ClassVar[str] = "count"
    needs_costs: ClassVar[bool] = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "batch_size", check_positive("batch_size", self.batch_size))

    def pad_unit(self, dp_size: int, pad_to: PadTo, accumulation_steps: int) -> int:
        """``PadTo.unit`` times the micro-batches of an optimizer step: a bucket padded to it
        fills whole optimizer steps (``pad_to="batch"``) or whole rounds of ranks (``rank``)."""
        return pad_to.unit(dp_size, self.batch_size) * accumulation_steps

    def steps(self, length: Any, dp_size: int) -> Any:
        """Global steps of a bucket of ``length`` padded entries (an int or an array) dealt to
        ``dp_size`` ranks: the batches of its largest share."""
        return -(-length // (dp_size * self.batch_size))

    def short_last_batch(self, pad_to: PadTo) -> bool:
        return pad_to is PadTo.RANK

    def describe(self) -> str:
        return str(self.batch_size)

    def summary(self) -> str:
        return f"batch {self.batch_size}"

    def fingerprint(self) -> Any:
        return self.batch_size


def as_sizing(batch_size: int | Count | Budget | Pack) -> Count | Budget | Pack:
    """The sizing ``batch_size`` names: a Budget, a Pack or a Count as given, an int as its Count.

    Raises:
        ConfigError: anything else (named as ``batch_size``).
    """
    if isinstance(batch_size, (Count, Budget, Pack)):
        return batch_size
    return Count(batch_size)
