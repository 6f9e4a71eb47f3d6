"""``wds-pad plan --summary --budget``: how full and how even a budgeted epoch's steps are.

Invariants:
- the mean fill counts each real sample once: padded copies add cost (they are in the
  worst balance) but no fill;
- a figure far past the budget prints as a multiple of it in 3 digits, never dozens of
  digits of a percentage.
"""

from __future__ import annotations

import argparse
from typing import Any, Sequence

from .common import format_table

__all__ = ["print_budget"]


def print_budget(sources: Sequence[Any], topo: Any, args: argparse.Namespace, common: dict[str, Any],
                 out: Any) -> None:
    """How full and how even a budgeted epoch's steps are, per bucket (``plan --summary
    --budget``): its steps, the mean fill (the cost of a rank's batch over the budget,
    each real sample counted once: padded copies add no fill), the worst balance (the
    costliest DP rank's batch, copies included, over the step's mean) and the batches
    over the budget (a sample dearer than it, alone). Plans every DP rank."""
    import numpy as np

    from ..core.budgets.budget import batch_cost
    from ..core.planning.plan import plan_epoch
    from ..core.topology import Topology

    budget = common["batch_size"]
    costs = [getattr(s, "dataset", s).cost for s in sources]
    per: dict[tuple[str, Any], dict[int, list[float]]] = {}
    real: dict[tuple[str, Any], list[float]] = {}  # each batch's cost without its padded copies
    for d in range(topo.dp_size):
        plan = plan_epoch(sources, Topology(topo.world_size, d * topo.cp_size, cp_size=topo.cp_size,
                                            local_world_size=topo.local_world_size),
                          epoch=args.epoch, mode=args.mode, warn=False, **common)
        for b in plan:
            c = costs[plan.datasets.index(b.dataset)]
            per.setdefault((b.dataset, b.bucket), {}).setdefault(b.step, []).append(
                batch_cost(np.asarray(c[b.samples], np.float64), budget.model))
            kept = b.samples[~b.pad]
            real.setdefault((b.dataset, b.bucket), []).append(
                batch_cost(np.asarray(c[kept], np.float64), budget.model) if kept.size else 0.0)
    rows = []
    for (ds, bucket), steps in per.items():
        worst = max((max(v) / (sum(v) / len(v)) if sum(v) else 1.0) for v in steps.values())
        over = sum(x > budget.limit for v in steps.values() for x in v)
        rows.append([ds, str(bucket), len(steps), _fill(float(np.mean(real[(ds, bucket)])) / budget.limit),
                     _times(worst), over])
    out.write(format_table(["dataset", "bucket", "steps", "mean fill", "worst balance", "over budget"], rows,
                           align="llrrrr") + "\n")
    every = [x for v in real.values() for x in v]
    out.write(f"budget {budget.limit:g} ({budget.model.value}): mean fill "
              f"{_fill(float(np.mean(every)) / budget.limit if every else 0.0)} over {len(every)} batches of "
              f"{topo.dp_size} DP ranks\n")


def _fill(x: float) -> str:
    """A fill (cost over budget) as a percentage; past 9999% (a sample far dearer than
    the budget, alone in its batch) as a multiple of the budget in 3 digits."""
    return f"{100 * x:.1f}%" if 100 * x < 9999.5 else f"{x:.3g}x"


def _times(x: float) -> str:
    return f"{x:.3f}x" if x < 1000 else f"{x:.3g}x"
