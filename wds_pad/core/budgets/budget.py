"""Budgeted batches: a bucket's batches sized by a cost budget instead of a sample count.

Each sample has a cost (tokens, pixels, seconds: a number the index records). A batch's
cost is the sum of its samples' costs (model ``sum``: what a packed or token-counting
step pays) or its count times its largest sample's cost (model ``max``: what padding to
the longest pays). A :class:`Budget` bounds it. How a bucket's batches are formed under
one: core/budgets/strata.py (``locality="none"``) and the lockstep cuts of
core/budgets/budgetplan.py (``locality="shard"``), which plans an epoch with them.

Invariants:
- a Budget is valid once built: a finite limit > 0, a known model, ``max_samples`` an
  int >= 1 or None; anything else is a ConfigError naming the field;
- :func:`pack` puts every item in exactly one batch, in an order that only depends on
  the weights, and every batch it makes is within the budget but for an item dearer
  than the budget, which travels alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from typing import Any, ClassVar

import numpy as np

from ...errors import ConfigError
from ..policy import check_positive, parse_enum

__all__ = ["OPEN_BINS", "PACKING", "Budget", "BudgetModel", "batch_cost", "fits_one_more", "pack"]

#: Batches kept open while packing a bucket's shuffled strata: a stratum goes into the
#: first open batch it fits; when none fits a new one opens, and past this many the
#: oldest is closed. More open batches fill them fuller and keep the order less.
OPEN_BINS = 8

#: How batches are packed under a budget (strata first fit over OPEN_BINS open batches,
#: lockstep cuts of shard-local entries), as the plan fingerprint records it: a change to
#: either algorithm changes it, so a state saved before cannot resume on different batches.
PACKING = "strata-firstfit8/lockstep-1"


class BudgetModel(str, Enum):
    """How a batch's cost is counted: ``sum`` of its samples' costs, or its count times
    its ``max`` sample's cost."""

    SUM = "sum"
    MAX = "max"


class ByStrata:
    """A sizing planned by strata of one entry per DP rank (a Budget, a Pack): a bucket is
    padded to a stratum (its batch count then made a multiple of ``accumulation_steps``,
    whatever ``pad_to``), and no batch is short: each holds what fits."""

    def pad_unit(self, dp_size: int, pad_to: Any = None, accumulation_steps: int = 1) -> int:
        return dp_size

    def short_last_batch(self, pad_to: Any) -> bool:
        return False


@dataclass(frozen=True)
class Budget(ByStrata):
    """A cost budget per batch, given instead of a batch size.

    Args:
        limit: the most a batch may cost (a finite number > 0).
        model: ``sum`` (a batch costs the sum of its samples' costs) or ``max`` (its
            count times its largest sample's cost).
        max_samples: the most samples a batch may hold (None: no bound but the budget).

    Raises:
        ConfigError: a value outside those ranges, named.
    """

    limit: float
    model: BudgetModel = BudgetModel.SUM
    max_samples: int | None = None
    kind: ClassVar[str] = "budget"  # its bucket cut (core/budgets/budgetplan.py budget_cut)
    needs_costs: ClassVar[bool] = True

    def __post_init__(self) -> None:
        lim = self.limit
        if isinstance(lim, bool) or not isinstance(lim, (int, float, np.integer, np.floating)) \
                or not math.isfinite(float(lim)) or float(lim) <= 0:
            raise ConfigError(f"Budget.limit must be a finite number > 0, got {lim!r}")
        object.__setattr__(self, "limit", float(lim))
        object.__setattr__(self, "model", parse_enum(BudgetModel, self.model, "budget model"))
        object.__setattr__(self, "max_samples", check_positive("Budget.max_samples", self.max_samples, optional=True))

    def pack(self, weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Items of ``weights``, in order, packed into batches within this budget: :func:`pack`
        (a sizing that packs otherwise, core/budgets/packing.py, overrides it)."""
        return pack(weights, self)

    def describe(self) -> str:
        return f"budget {self.limit:g}"

    def summary(self) -> str:
        return f"budget {self.limit:g} ({self.model.value})"

    def fingerprint(self) -> dict[str, Any]:
        return {**self.to_json(), "packing": PACKING}  # how batches are packed is part of the plan

    def to_json(self) -> dict[str, Any]:
        return {"limit": self.limit, "model": self.model.value, "max_samples": self.max_samples}


def batch_cost(costs: Any, model: BudgetModel | str = BudgetModel.SUM) -> float:
    """The cost of a batch whose samples cost ``costs``: their sum, or count x max."""
    c = np.asarray(costs, dtype=np.float64)
    if not c.size:
        return 0.0
    if BudgetModel(model) is BudgetModel.SUM:
        return float(c.sum())
    return float(c.size * c.max())


def pack(weights: np.ndarray, budget: Budget, open_bins: int = OPEN_BINS) -> tuple[np.ndarray, np.ndarray]:
    """Pack items of ``weights`` in order into batches within ``budget`` (first fit over
    at most ``open_bins`` open batches; an item heavier than the budget alone).

    Returns:
        (order, offsets): the item indices batch after batch, and where each batch
        starts in ``order`` (``len(batches) + 1`` entries). Batches come in the order
        they were opened; inside one, items in the order they were placed.
    """
    limit, cap = budget.limit, budget.max_samples or 0
    summed = budget.model is BudgetModel.SUM
    w = np.asarray(weights, dtype=np.float64).tolist()
    bins: list[list[int]] = []            # every batch's items, in opening order
    load: list[float] = []                # sum (or max) of each open batch's weights
    count: list[int] = []
    opened: list[int] = []                # indices into bins of the open ones, oldest first
    for i, x in enumerate(w):
        placed = False
        if x <= limit:
            for slot, b in enumerate(opened):
                c = count[slot]
                if cap and c >= cap:
                    continue
                if summed:
                    if load[slot] + x > limit:
                        continue
                    load[slot] += x
                else:
                    top = load[slot] if load[slot] >= x else x
                    if (c + 1) * top > limit:
                        continue
                    load[slot] = top
                count[slot] = c + 1
                bins[b].append(i)
                placed = True
                break
        if placed:
            continue
        bins.append([i])
        if x > limit or (cap == 1):
            continue  # alone for good: over the budget, or batches of one
        opened.append(len(bins) - 1)
        load.append(x)
        count.append(1)
        if len(opened) > open_bins:
            opened.pop(0)
            load.pop(0)
            count.pop(0)
    return flat_bins(bins)


def flat_bins(bins: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """(order, offsets) of ``bins``: their items bin after bin, and where each bin starts."""
    sizes = np.fromiter((len(b) for b in bins), dtype=np.int64, count=len(bins))
    offsets = np.zeros(len(bins) + 1, np.int64)
    np.cumsum(sizes, out=offsets[1:])
    return np.fromiter((i for b in bins for i in b), dtype=np.int64, count=int(offsets[-1])), offsets


def fits_one_more(load: float, count: int, x: float, budget: Budget) -> bool:
    """Whether an item of weight ``x`` fits a batch of ``count`` items whose sum (model
    ``sum``) or largest (``max``) weight is ``load``."""
    if budget.max_samples and count >= budget.max_samples:
        return False
    if budget.model is BudgetModel.SUM:
        return load + x <= budget.limit
    return (count + 1) * max(load, x) <= budget.limit
