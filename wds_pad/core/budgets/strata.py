"""A bucket's batches under a budget, the same on every rank (``locality="none"``).

How they are formed:

1. **Strata.** The bucket's samples in cost order (ties by sample id) are cut into strata
   of ``dp_size`` consecutive samples, per pass (``1 + repeats`` passes); the
   ``samples mod dp_size`` left over in each pass (a run of the cost order at a start
   drawn from seed, epoch, dataset and bucket, the same run in every pass) make the tail
   strata, in cost order. A stratum gives exactly one sample to every DP rank, so the ranks'
   batches at a step have the same count and nearly the same costs.
2. **Packing.** The strata are shuffled (a keyed permutation) and packed in that order,
   first fit into at most ``OPEN_BINS`` open batches, a stratum weighing its largest
   member's cost: a batch is a set of strata, and the batch of every rank at that step
   takes one member of each. Its cost is at most the budget on every rank (a stratum
   heavier than the budget travels alone). The last tail stratum, when it has fewer than
   ``dp_size`` members, comes last.
3. **Members.** Which member of a stratum a rank takes is a keyed permutation of the
   ranks per batch, reversed on every other stratum of the batch ("snake"), so the rank
   that takes a stratum's dearest member takes the next one's cheapest.
4. **Padding.** ``cyclic`` fills the last tail stratum with copies of its own members
   (and, with ``pad_to="batch"``, tops the bucket's last batch up with copies of the
   first strata while they fit); ``drop`` drops that stratum; ``none`` leaves it short
   (the ranks past its members have one entry fewer). With ``accumulation_steps`` K a
   bucket's batch count is made a multiple of K: ``cyclic`` repeats its first batches
   (marked padded copies), ``drop`` drops its last ones.

Invariants:
- every rank's batch is within the budget under its model, unless it is one stratum
  heavier than the budget (``over_budget`` counts them);
- at each of a bucket's batches every DP rank takes one member of each of its strata:
  equal counts (but for ``none``'s short stratum), so equal steps per rank;
- over the DP ranks an epoch holds every entry (sample x pass) exactly once, plus the
  marked copies; ``drop`` never repeats one;
- pure: the same (costs, seed, epoch, layout, budget) give the same batches anywhere;
  a bucket costs O(its entries / dp_size) to plan (the rank's share), O(1) per entry
  to evaluate.
"""

from __future__ import annotations

from typing import Callable, Iterable

import numpy as np

from .budget import Budget, BudgetModel, fits_one_more
from ..permute import keyed_round_keys as _keys, permute
from ..seed import derive_seed

__all__ = ["BucketBatches"]


class BucketBatches:
    """One kept bucket's budgeted batches for one epoch on one DP layout (see the module doc).

    Args:
        n: samples in the bucket.
        passes: 1 + repeats.
        dp: DP ranks.
        sorted_cost: ``sorted_cost(pos)`` -> the costs (float64) of the bucket's samples at
            positions ``pos`` of its cost order.
        base_key: a 64-bit key derived from (seed, epoch, dataset, bucket).
        budget: the budget.
        policy: ``"cyclic"``, ``"drop"`` or ``"none"`` (resolved).
        oversubscribe: keep a bucket with fewer entries than ``dp`` (cyclic only).
        top_up: fill the last batch with copies of the first strata (``pad_to="batch"``).
        accumulation_steps: K: the batch count is made a multiple of K.

    Attributes:
        seq: stratum ids in packed order, batch after batch.
        offsets: where each batch starts in ``seq``.
        copy: per ``seq`` entry, whether it is a whole copied stratum (padding).
        short: id of the last tail stratum when it has fewer than ``dp`` members (-1: none).
        short_size: its members.
        dropped: the bucket plans nothing (too small, or every batch dropped).
    """

    def __init__(self, n: int, passes: int, dp: int, sorted_cost: Callable[[np.ndarray], np.ndarray],
                 base_key: int, budget: Budget, policy: str, oversubscribe: bool = False,
                 top_up: bool = False, accumulation_steps: int = 1) -> None:
        self.n, self.passes, self.dp, self.budget = int(n), int(passes), int(dp), budget
        self.base_key = int(base_key)
        self.uneven = policy == "none"  # the short stratum stays short
        rem = self.n % self.dp
        self.full = self.n // self.dp                    # complete strata per pass
        self.rem = rem
        # the ``rem`` samples left over in every pass: a run of the cost order at a random
        # start (keyed), the same in each pass, so the strata made of them stay tight
        self.run = 0
        if rem:
            self.run = derive_seed(self.base_key, "leftover") % (self.n - rem + 1)
        tl = np.tile(self.run + np.arange(rem, dtype=np.int64), self.passes)
        tp = np.repeat(np.arange(self.passes, dtype=np.int64), rem)
        o = np.lexsort((tp, tl))
        self.tail_pos, self.tail_pass = tl[o], tp[o]
        tail = int(tl.size)
        self.tail_full = tail // self.dp
        self.short_size = tail % self.dp
        self.complete = self.passes * self.full + self.tail_full   # strata with dp members
        self.short = self.complete if self.short_size else -1
        self.entries = self.n * self.passes                        # real entries over all ranks
        self.over_budget = 0
        self.dropped = False
        keep_short = self.short >= 0 and (policy == "none" or policy == "cyclic")
        if self.complete == 0 and not (policy == "none" or (policy == "cyclic" and oversubscribe)):
            keep_short = False
        total = self.complete + (1 if keep_short else 0)
        if total == 0:
            self._empty(dropped=self.entries > 0)
            return
        weights = self._weights(sorted_cost, total)
        # shuffled complete strata, then the short one
        if self.complete:
            order = permute(np.arange(self.complete, dtype=np.int64), np.full(self.complete, self.complete, np.int64),
                            np.repeat(_keys(self.base_key, np.zeros(1, np.int64)), self.complete, axis=1))
        else:
            order = np.zeros(0, np.int64)
        packed, offsets = budget.pack(weights[order])
        seq = order[packed]
        self.over_budget = int(np.count_nonzero(weights > budget.limit))
        copy = np.zeros(seq.size, bool)
        if keep_short:
            seq, offsets, copy = self._place_short(seq, offsets, copy, weights)
        if policy == "cyclic" and top_up and self.complete:
            seq, offsets, copy = self._top_up(seq, offsets, copy, weights)
        seq, offsets, copy = self._whole_cycles(seq, offsets, copy, int(accumulation_steps), policy)
        if seq.size == 0:
            self._empty(dropped=True)
            return
        self.seq, self.offsets, self.copy = seq, offsets, copy
        self.weights = weights
        real = seq[~copy]
        self.real = int(np.count_nonzero(real != self.short)) * self.dp + (
            self.short_size if self.short >= 0 and np.any(real == self.short) else 0)
        self.planned = self.real if policy == "none" else int(seq.size) * self.dp
        self.truncated = self.entries - self.real

    def _empty(self, dropped: bool) -> None:
        self.seq = np.zeros(0, np.int64)
        self.offsets = np.zeros(1, np.int64)
        self.copy = np.zeros(0, bool)
        self.weights = np.zeros(0, np.float64)
        self.dropped = dropped
        self.real = self.planned = 0
        self.truncated = self.entries if dropped else 0

    # -- building ----------------------------------------------------------------------
    def _weights(self, sorted_cost: Callable[[np.ndarray], np.ndarray], total: int) -> np.ndarray:
        """Each stratum's weight: its dearest member's cost (its last, in cost order)."""
        w = np.empty(total, np.float64)
        per = self.passes * self.full
        if per:
            p = np.repeat(np.arange(self.passes, dtype=np.int64), self.full)
            t = np.tile(np.arange(self.full, dtype=np.int64), self.passes)
            w[:per] = sorted_cost(self._position(p, t * self.dp + self.dp - 1))
        tails = total - per
        if tails:
            last = np.minimum((np.arange(tails, dtype=np.int64) + 1) * self.dp, self.tail_pos.size) - 1
            w[per:] = sorted_cost(self.tail_pos[last])
        return w

    def _position(self, p: np.ndarray, kept: np.ndarray) -> np.ndarray:
        """Cost-order positions of kept index ``kept`` (of any pass): the leftover run skipped."""
        return np.where(kept < self.run, kept, kept + self.rem)

    def _place_short(self, seq: np.ndarray, offsets: np.ndarray, copy: np.ndarray,
                     weights: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The short tail stratum, last: into the last batch if it fits, else its own."""
        fits = offsets.size > 1 and self._fitting(weights[seq[offsets[-2]:]], [float(weights[self.short])])
        return (np.append(seq, self.short), np.append(offsets[:-1] if fits else offsets, offsets[-1] + 1),
                np.append(copy, False))

    def _fitting(self, last: np.ndarray, xs: Iterable[float]) -> int:
        """How many strata of weights ``xs``, in order, fit one after another into a batch
        whose strata weigh ``last``."""
        summed, k = self.budget.model is BudgetModel.SUM, 0
        load = (float(last.sum()) if summed else float(last.max())) if last.size else 0.0
        for x in xs:
            if x > self.budget.limit or not fits_one_more(load, int(last.size) + k, x, self.budget):
                break
            load, k = load + x if summed else max(load, x), k + 1
        return k

    def _top_up(self, seq: np.ndarray, offsets: np.ndarray, copy: np.ndarray,
                weights: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Copies of the first complete strata (in packed order) into the last batch while
        they fit: the bucket's last step as full as the others (``pad_to="batch"``)."""
        whole = seq[seq != self.short]
        add = whole[:self._fitting(weights[seq[offsets[-2]:]], (float(weights[u]) for u in whole.tolist()))]
        if not add.size:
            return seq, offsets, copy
        return (np.concatenate([seq, add]), np.append(offsets[:-1], offsets[-1] + add.size),
                np.concatenate([copy, np.ones(add.size, bool)]))

    def _whole_cycles(self, seq: np.ndarray, offsets: np.ndarray, copy: np.ndarray, accumulation_steps: int,
                      policy: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A batch count that is a multiple of ``accumulation_steps``: the first batches
        again (cyclic, marked copies) or the last ones dropped (drop)."""
        bins = offsets.size - 1
        if accumulation_steps <= 1 or bins % accumulation_steps == 0:
            return seq, offsets, copy
        if policy == "drop":
            keep = bins - bins % accumulation_steps
            cut = int(offsets[keep])
            return seq[:cut], offsets[:keep + 1], copy[:cut]
        need = accumulation_steps - bins % accumulation_steps
        sizes = np.diff(offsets)
        reps = np.arange(need) % bins
        add_sizes = sizes[reps]
        add = np.concatenate([seq[offsets[r]:offsets[r + 1]] for r in reps.tolist()])
        new_off = np.concatenate([offsets, offsets[-1] + np.cumsum(add_sizes)])
        return np.concatenate([seq, add]), new_off, np.concatenate([copy, np.ones(add.size, bool)])

    # -- reading -----------------------------------------------------------------------
    @property
    def batches(self) -> int:
        """Batches of this bucket: the same on every rank (its global steps)."""
        return int(self.offsets.size - 1)

    def count(self, d: int) -> int:
        """Entries of DP rank ``d`` in this bucket (one per stratum; ``none``'s short
        stratum only for its first ``short_size`` ranks)."""
        n = int(self.seq.size)
        if self.uneven and self.short >= 0 and n and self.seq[-1] == self.short and d >= self.short_size:
            return n - 1
        return n

    def at(self, d: np.ndarray, k: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Entries ``k`` of DP ranks ``d``: (cost-order position, pass, padded copy)."""
        d = np.asarray(d, np.int64)
        k = np.asarray(k, np.int64)
        u = self.seq[k]
        w = np.searchsorted(self.offsets, k, side="right") - 1
        t = k - self.offsets[w]
        slot = permute(d, np.full(d.size, self.dp, np.int64), _keys(self.base_key ^ 0xB1A5, w))
        slot = np.where(t % 2 == 1, self.dp - 1 - slot, slot)
        pad = self.copy[k].copy()
        pos = np.empty(k.size, np.int64)
        passes = np.empty(k.size, np.int64)
        per = self.passes * self.full
        plain = u < per
        if plain.any():
            p = u[plain] // max(self.full, 1)
            t_ = u[plain] % max(self.full, 1)
            pos[plain] = self._position(p, t_ * self.dp + slot[plain])
            passes[plain] = p
        tail = ~plain
        if tail.any():
            j = u[tail] - per
            s = slot[tail]
            short = j == self.tail_full
            s = np.where(short, d[tail], s)  # the short stratum: rank d takes member d
            if self.short_size:
                over = short & (s >= self.short_size)
                pad[np.flatnonzero(tail)[over]] = True
                s = np.where(short, s % max(self.short_size, 1), s)
            q = j * self.dp + s
            pos[tail] = self.tail_pos[q]
            passes[tail] = self.tail_pass[q]
        return pos, passes, pad

    def member_runs(self, strata: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The real members of ``strata`` (ids) as runs of codes ``pass * n + position``
        (a stratum's members are consecutive in cost order but for the leftover run it
        may straddle, and the tail's, which come one by one): (first codes, lengths)."""
        strata = np.asarray(strata, np.int64)
        per = self.passes * self.full
        plain = strata[strata < per]
        p, t = plain // max(self.full, 1), plain % max(self.full, 1)
        lo = t * self.dp                                   # kept index of the first member
        hi = lo + self.dp
        base = p * self.n
        # kept indices below the leftover run sit at their place; at or above it, rem further on
        a_len = np.clip(np.minimum(hi, self.run) - lo, 0, self.dp)
        b_start = np.maximum(lo, self.run) + self.rem
        b_len = self.dp - a_len
        starts = np.concatenate([base + lo, base + b_start])
        lengths = np.concatenate([a_len, b_len])
        tails = strata[strata >= per] - per
        if tails.size:
            size = np.where(tails == self.tail_full, self.short_size, self.dp)
            q = np.repeat(tails * self.dp, size) + _ranges(size)
            starts = np.concatenate([starts, self.tail_pass[q] * self.n + self.tail_pos[q]])
            lengths = np.concatenate([lengths, np.ones(q.size, np.int64)])
        keep = lengths > 0
        return starts[keep], lengths[keep]


def _ranges(sizes: np.ndarray) -> np.ndarray:
    """``concatenate([arange(s) for s in sizes])`` without a Python loop."""
    total = int(sizes.sum())
    if not total:
        return np.zeros(0, np.int64)
    ends = np.cumsum(sizes)
    return np.arange(total, dtype=np.int64) - np.repeat(ends - sizes, sizes)
