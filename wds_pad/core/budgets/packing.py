"""Sequence packing as a sizing: each batch is ``packs`` packs of at most ``seq_len`` cost.

A :class:`Pack` sizes batches for training on packed sequences: every batch of a DP rank
is B packs, each pack a set of samples of one bucket whose costs (tokens) sum to at most
``seq_len`` (and, with ``max_segments``, at most that many samples). It is planned as a
budget of ``seq_len`` per pack (core/budgets/budgetplan.py: strata of one sample per DP rank, so
every rank's pack at a step has the same count and nearly the same cost), with the packs
grouped B at a time into batches (core/budgets/packplan.py). The packs are formed by
:func:`best_fit_windows`: best fit decreasing over windows of the bucket's seeded order,
so the epoch still shuffles while the fill is that of an offline packer.

Invariants:
- a Pack is valid once built (``seq_len`` and ``packs`` ints >= 1, ``max_segments`` an
  int >= 1 or None, ``oversize`` ``"refuse"`` or ``"alone"``); anything else is a
  ConfigError naming the field;
- :func:`best_fit_windows` puts every item in exactly one pack; a pack's weights sum to
  at most the limit (an item heavier than it alone) and it holds at most ``max_samples``
  items; inside a pack, items keep their order; packs of a window come in the order of
  their first item.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from ...errors import ConfigError
from ..policy import check_positive
from .budget import Budget, BudgetModel, ByStrata, flat_bins

__all__ = ["OVERSIZE", "PACK_PACKING", "WINDOW", "Pack", "PackBudget", "best_fit_windows"]

#: Strata packed together: best fit decreasing inside each window of this many items of
#: the seeded order (a shorter last window joins the one before it). Larger fills fuller
#: and shuffles less.
WINDOW = 8192

#: How packs are formed, as the plan fingerprint records it: a change to the algorithm
#: changes it, so a state saved before cannot resume on different packs.
PACK_PACKING = f"bfd-window{WINDOW}/lockstep-1"

#: What a sample costlier than ``seq_len`` does: refused at plan time, or a pack of its own.
OVERSIZE = ("refuse", "alone")


@dataclass(frozen=True)
class Pack(ByStrata):
    """Batches of ``packs`` packs per DP rank, each at most ``seq_len`` tokens (costs).

    Args:
        seq_len: the most a pack may cost (the index's cost column: tokens).
        packs: packs per batch (B: a batch's ``input_ids`` are (B, seq_len)).
        max_segments: the most samples a pack may hold (None: no bound but ``seq_len``).
        oversize: ``"refuse"`` (a sample costlier than ``seq_len`` is a ConfigError at plan
            time) or ``"alone"`` (it travels alone in a pack of its own, which the
            collate truncates to ``seq_len``).

    Raises:
        ConfigError: a value outside those ranges, named.
    """

    seq_len: int
    packs: int = 1
    max_segments: int | None = None
    oversize: str = "refuse"
    kind: ClassVar[str] = "pack"  # its bucket cut (core/budgets/packplan.py PackCut)
    needs_costs: ClassVar[bool] = True

    def __post_init__(self) -> None:
        for name in ("seq_len", "packs", "max_segments"):
            value = check_positive(f"Pack.{name}", getattr(self, name), optional=name == "max_segments")
            object.__setattr__(self, name, value)
        if self.oversize not in OVERSIZE:
            raise ConfigError(f"Pack.oversize must be one of {', '.join(OVERSIZE)}, got {self.oversize!r}")

    def budget(self) -> PackBudget:
        """The budget of one pack: what the strata are packed under (core/budgets/budgetplan.py)."""
        return PackBudget(float(self.seq_len), BudgetModel.SUM, self.max_segments)

    def describe(self) -> str:
        return f"pack {self.seq_len} x {self.packs}"

    def summary(self) -> str:
        return self.describe()

    def fingerprint(self) -> dict[str, Any]:
        return {"pack": {**self.to_json(), "packing": PACK_PACKING}}  # how packs are formed is part of the plan

    def to_json(self) -> dict[str, Any]:
        return {"seq_len": self.seq_len, "packs": self.packs, "max_segments": self.max_segments,
                "oversize": self.oversize}


@dataclass(frozen=True)
class PackBudget(Budget):
    """The budget of one pack: a sum budget whose batches are formed by :func:`best_fit_windows`."""

    def pack(self, weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return best_fit_windows(weights, self.limit, self.max_samples or 0)


def best_fit_windows(weights: Any, limit: float, cap: int = 0, window: int = WINDOW) -> tuple[np.ndarray, np.ndarray]:
    """Pack items of ``weights`` into packs of total weight <= ``limit`` (and <= ``cap`` items,
    0: no bound): best fit decreasing inside each window of ``window`` items.

    Returns:
        (order, offsets) as :func:`~wds_pad.core.budgets.budget.pack`: item indices pack after
        pack, and where each pack starts (``len(packs) + 1`` entries).
    """
    w = np.asarray(weights, dtype=np.float64)
    n = int(w.size)
    packs: list[list[int]] = []
    lo = 0
    while lo < n:
        hi = min(n, lo + window)
        if n - hi < window // 4:
            hi = n  # a short last window joins this one
        packs.extend(_best_fit(w, lo, hi, limit, cap))
        lo = hi
    return flat_bins(packs)


def _best_fit(w: np.ndarray, lo: int, hi: int, limit: float, cap: int) -> list[list[int]]:
    """Best fit decreasing of items ``[lo, hi)``: each item, largest first, into the open pack
    with the least room that holds it, else a new one."""
    idx = (lo + np.argsort(-w[lo:hi], kind="stable")).tolist()
    vals = w[lo:hi][np.asarray(idx, np.int64) - lo].tolist() if idx else []
    packs: list[list[int]] = []
    room: list[tuple[float, int]] = []  # (room left, pack) of the open packs, sorted
    for i, x in zip(idx, vals):
        if x > limit:
            packs.append([i])  # alone for good
            continue
        j = bisect_left(room, (x, -1))
        if j < len(room):
            left, p = room.pop(j)
            packs[p].append(i)
            left -= x
        else:
            p = len(packs)
            packs.append([i])
            left = limit - x
        if left > 0 and (not cap or len(packs[p]) < cap):
            insort(room, (left, p))
    for p in packs:
        p.sort()
    packs.sort(key=lambda p: p[0])
    return packs
