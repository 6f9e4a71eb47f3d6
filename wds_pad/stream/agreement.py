"""The cross-rank agreement check: every rank streams the same plan, or none starts.

Invariants:
- one small collective (``all_gather_object`` of a few fields) per call, over the job's
  group; a no-op without an initialised process group or with one rank;
- ranks compare what must agree: the plan fingerprint (seed, datasets, batch size,
  policy, data-parallel layout), the epoch, the mode and, in an epoch resumed on another
  layout, the remainder's fingerprint; and the epoch's batch count under the lockstep
  policies (``cyclic``, ``drop``), where a difference is a bug, never under ``none``,
  which gives ranks different counts by design. On any difference every rank raises the
  same StateMismatchError, naming the ranks and each differing leaf field of the plan
  (``datasets[0].index_digest``), before any batch;
- it never creates, changes or destroys a process group.
"""

from __future__ import annotations

from typing import Any

from ..core.collective import all_gather, group_size
from ..core.policy import Policy
from ..errors import StateMismatchError
from ..state.schema import flatten
from ..state.cursor import Cursor
from ..state.spec import PlanSpec

__all__ = ["check_agreement"]


def check_agreement(spec: PlanSpec, cursor: Cursor, group: Any = None) -> None:
    """All ranks compare plan fingerprint, epoch and mode (one all_gather), in an epoch
    resumed on another layout (the cursor's elastic view) the remainder's fingerprint, and
    the epoch's batch count unless the policy is ``none`` (uneven by design).

    Args:
        spec: this rank's PlanSpec.
        cursor: where this rank starts (``Position(epoch, index)``, or a loader's cursor).
        group: the torch.distributed group of the job (default: the default group).

    Raises:
        StateMismatchError: on every rank, naming the ranks and fields that differ.
    """
    if group_size(group) == 1:  # one process: nothing to compare
        return
    view = cursor.view
    resumed = view is not None and view.epoch == cursor.epoch
    mine = {"rank": spec.topology.rank, "fingerprint": spec.fingerprint(),
            "epoch": cursor.epoch,
            "batches": cursor.length(spec),
            "mode": spec.mode.value, "plan": spec.fingerprint_fields(),
            "lockstep": spec.resolved_policy is not Policy.NONE,
            "elastic": view.fingerprint if resumed else ""}  # type: ignore[union-attr]
    gathered: list[Any] = all_gather(mine, group) or [mine]
    ref = gathered[0]
    # every rank decides from the same gathered values, so every rank raises alike
    lockstep = any(x.get("lockstep", True) for x in gathered)
    compared = ("fingerprint", "epoch", "batches", "mode", "elastic") if lockstep else (
        "fingerprint", "epoch", "mode", "elastic")
    bad = []
    for other in gathered[1:]:
        fields = [k for k in compared if other.get(k) != ref.get(k)]
        if fields:
            detail = ", ".join(f"{k}: rank {ref['rank']} {ref[k]!r} vs rank {other['rank']} {other[k]!r}"
                               for k in fields if k != "fingerprint")
            # one row per leaf field: "datasets[0].index_digest", not two whole dataset lists
            mine_f, theirs_f = (flatten(x["plan"], "plan") for x in (ref, other))
            plan_diff = [k for k in {**mine_f, **theirs_f} if mine_f.get(k) != theirs_f.get(k)]
            if plan_diff:
                detail += (", " if detail else "") + "plan fields differ: " + ", ".join(
                    f"{k[len('plan.'):]} (rank {ref['rank']}: {mine_f.get(k)!r}, rank {other['rank']}: "
                    f"{theirs_f.get(k)!r})" for k in plan_diff)
            bad.append(f"rank {other['rank']} differs from rank {ref['rank']}: {detail or 'fingerprint'}")
    if bad:
        raise StateMismatchError(
            "ranks disagree on the plan before the first batch: " + "; ".join(bad) +
            ". Every rank must use the same index, seed, batch size and policy "
            "(pass check_agreement=False to skip this check)"
        )
