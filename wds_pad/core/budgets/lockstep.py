"""A bucket's batches under a budget when every rank keeps its own entries (``locality="shard"``).

Shard locality gives each DP rank its own entries of a bucket, in the order its shards'
windows are read; to keep that order a batch is a run of them. :func:`lockstep_cuts`
cuts every rank's run into the same number of batches, each within the budget.

Invariants:
- every rank gets the same batch count S (a multiple of ``accumulation_steps``) and, while it
  has at least S entries, no empty batch; every entry is in exactly one batch, in order;
- every batch is within the budget (but for an entry dearer than it: then every batch
  is one entry), and holds at most ``max_samples`` entries;
- pure numpy on the costs it is given.
"""

from __future__ import annotations

import math

import numpy as np

from .budget import Budget, BudgetModel

__all__ = ["lockstep_cuts"]


def lockstep_cuts(costs: np.ndarray, counts: np.ndarray, budget: Budget,
                  accumulation_steps: int = 1) -> tuple[int, np.ndarray]:
    """Cut every DP rank's own entry sequence of a bucket into the same number of batches,
    in order (``locality="shard"``: a rank's entries follow its shards' windows, so a
    batch is a run of them), each within ``budget``.

    Args:
        costs: (dp, r) costs of each rank's entries in its order (columns past
            ``counts[d]`` are ignored).
        counts: entries of each rank (equal but for policy ``none``).
        budget: the budget.
        accumulation_steps: the batch count is a multiple of this (gradient accumulation).

    Returns:
        (batches, cuts): the batch count S, the same for every rank, and (dp, S + 1) entry
        offsets: rank d's batch w is its entries ``cuts[d, w]:cuts[d, w + 1]``. Under
        ``sum`` a rank's batches are cut where its running cost passes each multiple of
        its total / S, and S is the least (rounded up to ``accumulation_steps``) that keeps every
        batch of every rank within the budget that way: ``ceil(max_d total_d / (limit -
        largest entry))``. Under ``max``, or where ``max_samples`` binds, batches hold
        equal counts (within one) of at most ``floor(limit / largest entry)`` entries.
        An entry dearer than the budget makes every batch one entry.
    """
    dp = costs.shape[0]
    counts = np.asarray(counts, np.int64)
    r = int(counts.max(initial=0))
    if r == 0:
        return 0, np.zeros((dp, 1), np.int64)
    live = np.arange(costs.shape[1])[None, :] < counts[:, None]
    c = np.where(live, costs, 0.0)
    top = float(c.max())
    cap = budget.max_samples or r
    per = max(1, min(cap, int(budget.limit // top))) if 0 < top <= budget.limit else (1 if top else cap)

    def rounded(s: int) -> int:
        return min(-(-max(s, 1) // accumulation_steps) * accumulation_steps, r)

    def even(s: int) -> tuple[int, np.ndarray]:
        w = np.arange(s + 1, dtype=np.int64)[None, :]
        return s, np.minimum(w * r // s, counts[:, None])

    if top > budget.limit or budget.model is BudgetModel.MAX:
        return even(rounded(-(-r // per)))
    totals = c.sum(axis=1)
    room = budget.limit - top  # what a batch may hold beyond its largest entry
    need = int(math.ceil(float(totals.max()) / room)) if room > 0 else r
    s = rounded(max(need, -(-r // cap)))
    cum = np.cumsum(c, axis=1)
    cuts = np.zeros((dp, s + 1), np.int64)
    for d in range(dp):
        n = int(counts[d])
        if n == 0:
            continue
        # entry j goes to batch floor(midpoint_j * S / total): a batch costs at most
        # total / S + the largest entry <= limit
        mid = cum[d, :n] - c[d, :n] / 2.0
        if totals[d] > 0:
            part = np.minimum((mid * (s / float(totals[d]))).astype(np.int64), s - 1)
        else:
            part = np.arange(n, dtype=np.int64) * s // n
        cuts[d, 1:] = np.searchsorted(part, np.arange(1, s + 1), side="left")
        cuts[d] = _non_empty(cuts[d], n)
        if int(np.diff(cuts[d]).max(initial=0)) > cap:  # the count bound binds: even counts
            return even(rounded(-(-r // per)))
    return s, cuts


def _non_empty(cut: np.ndarray, n: int) -> np.ndarray:
    """Offsets moved so that every batch holds an entry (while there are as many entries
    as batches): a batch either keeps a subset of its entries or takes a single one, so
    none gets dearer than the budget allowed."""
    s = cut.size - 1
    k = np.arange(s + 1, dtype=np.int64)
    up = np.maximum.accumulate(cut - k) + k          # strictly increasing from the front
    return np.minimum(up, np.maximum(n - (s - k), k.clip(max=n)))  # ... and room at the end
