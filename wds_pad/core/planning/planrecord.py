"""The plan as records: ``Plan`` (this rank's batches for one epoch, evaluated lazily),
``Batch`` and ``BucketStats``, and how a rank's entries are computed from per-bucket facts.

``plan_epoch`` (core/planning/plan.py) builds a Plan from O(buckets + steps) facts; the sample ids
of a batch are computed when it is asked for, here.

Invariants:
- a Plan costs O(buckets + steps) to set up and to hold, a batch O(batch size), and
  ``samples`` / ``pad`` (every entry of the rank) O(the rank's share), on first use;
- entry k of kept bucket b on dp_rank d is global position p = d + k * dp_size of the
  bucket's order; it is a padded copy iff p >= the bucket's unpadded length, and its
  sample is the keyed permutation of its pass evaluated at p (core/permute.py), or the
  shard-local order's entry (core/local/locality.py): the ``EntryOrder`` the buckets were made with;
- ``plan[i]`` equals ``plan.batches(i, i + 1)[0]`` and the slices of ``samples`` / ``pad``,
  bitwise; a MemoryError while computing entries is a ConfigError that says what to lower.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Hashable, Iterator, Protocol, Sequence

import numpy as np

from ...errors import ConfigError
from ..permute import ROUNDS, permute
from ..policy import Mode, PadTo, Policy, rank_position
from ..sampleseed import seed_bases, seeded_entries

if TYPE_CHECKING:  # the records a Plan holds; their modules plan, this one only records
    from ..local.locality import Locality
    from ..sizing import Sizing
    from ..topology import Topology

__all__ = ["Batch", "BucketStats", "Plan"]

@dataclass(frozen=True)
class BucketStats:
    """What the plan did with one (dataset, bucket), identical on every rank."""

    dataset: str
    bucket: Hashable
    samples: int          # distinct samples in the bucket
    repeats: int          # configured repeats
    length: int           # samples * (1 + repeats), before padding
    padded_length: int    # global length after padding / truncation (0 if dropped)
    padded_copies: int    # entries added by cyclic padding
    truncated: int        # entries removed by drop
    dropped: bool         # the whole bucket is out of this epoch
    oversubscribed: bool  # kept below one pad unit by explicit consent
    steps: int            # global steps this bucket takes per epoch

    @property
    def effective_repeats(self) -> float:
        """Appearances per sample minus one, after padding (oversubscribed buckets > repeats)."""
        return self.padded_length / self.samples - 1 if self.samples else 0.0

    @property
    def padded_fraction(self) -> float:
        """Padded copies as a fraction of the padded length."""
        return self.padded_copies / self.padded_length if self.padded_length else 0.0


@dataclass(frozen=True)
class Batch:
    """One batch of this rank: never mixes buckets or datasets."""

    epoch: int
    step: int            # global step within the epoch (identical on every rank)
    index: int           # position in this rank's plan for the epoch
    dataset: str
    bucket: Hashable
    samples: np.ndarray  # int64 sample ids
    pad: np.ndarray      # bool: True for a padded copy
    pack: np.ndarray | None = None  # under a Pack: each sample's pack number in the batch
    seeds: np.ndarray | None = None  # uint64: each entry's seed (core/sampleseed.py)

    def to_json(self, topology: Topology) -> dict[str, Any]:
        """The ``wds-pad plan --json`` record of this batch."""
        row = {
            "rank": topology.rank,
            "dp_rank": topology.dp_rank,
            "step": self.step,
            "epoch": self.epoch,
            "dataset": self.dataset,
            "bucket": self.bucket,
            "samples": self.samples.tolist(),
            "pad": self.pad.tolist(),
            **({} if self.seeds is None else {"seeds": self.seeds.tolist()}),
        }
        if self.pack is not None:
            row["pack"] = self.pack.tolist()
        return row


@dataclass(frozen=True, eq=False)
class Plan:
    """This rank's ordered batches for one epoch, evaluated lazily (see the module's invariants).

    ``schedule[s]`` is the bucket-table index every rank takes at global step s and
    ``window[s]`` how many earlier steps took the same bucket; ``batch_step[i]`` is the
    global step of this rank's i-th batch, which holds ``offsets[i + 1] - offsets[i]``
    entries. ``batch_size`` is the widest batch: a Count's, or the widest planned under a Budget.
    """

    epoch: int
    topology: Topology
    batch_size: int
    policy: Policy
    mode: Mode
    pad_to: PadTo
    oversubscribe: bool
    datasets: tuple[str, ...]
    bucket_table: tuple[tuple[int, Hashable], ...]  # (dataset index, bucket key)
    schedule: np.ndarray
    window: np.ndarray
    batch_step: np.ndarray
    offsets: np.ndarray
    stats: tuple[BucketStats, ...] = field(repr=False)
    buckets: Buckets = field(repr=False)
    sizing: Sizing  # how batches are sized: a Count, a Budget or a Pack (core/sizing.py)
    locality: Locality
    shard_window: int = 8  # shards a rank visits at once (locality="shard")
    bins: Bins | None = field(default=None, repr=False)  # where each batch starts (a budget's batches vary)
    accumulation_steps: int = 1  # micro-batches per optimizer step: each bucket's steps come K at a time
    packs: Any = field(default=None, repr=False)  # a Pack's pack numbers (core/budgets/packplan.py), or None
    seed: int | None = None  # the shared seed: each entry's seed derives from it (None: no seeds)
    pad_unit: int = 0  # what each bucket's list was padded to a multiple of (its sizing's cut's unit)

    def _first(self, b: np.ndarray, w: np.ndarray) -> np.ndarray:
        """Where window ``w`` of kept bucket ``b`` starts among this rank's entries of it."""
        if self.bins is None:
            return np.asarray(w, np.int64) * self.batch_size
        return self.bins.start(b, w)

    @property
    def steps(self) -> int:
        """Global steps in this epoch."""
        return int(self.schedule.size)

    def __len__(self) -> int:
        return int(self.batch_step.size)

    def __getitem__(self, i: int) -> Batch:
        n = len(self)
        if isinstance(i, bool) or not isinstance(i, (int, np.integer)):
            raise TypeError(f"plan indices are ints, got {type(i).__name__}")
        if not -n <= i < n:
            raise IndexError(f"batch {i} out of range for a plan of {n} batches")
        return self.batches(int(i) % n, int(i) % n + 1)[0]

    def _entry_keys(self, steps: np.ndarray, sizes: np.ndarray, before: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(kept bucket, entry number in it) of every entry of the rank's batches at global
        ``steps``, of ``sizes`` entries, ``before`` entries before each."""
        t = self.schedule[steps].astype(np.int64)
        first = self._first(t, self.window[steps].astype(np.int64))
        return np.repeat(t, sizes), np.repeat(first - before, sizes) + np.arange(int(sizes.sum()), dtype=np.int64)

    def _seeded(self, b: np.ndarray, k: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """(samples, pad, seeds) of entries ``k`` of kept buckets ``b`` (core/sampleseed.py)."""
        if self.seed is not None and "_seed_bases" not in self.__dict__:  # per kept bucket: its dataset's key
            ds = np.asarray([di for di, _ in self.bucket_table], np.int64)
            self.__dict__["_seed_bases"] = seed_bases(self.seed, self.epoch, self.datasets)[ds]
        return seeded_entries(self.buckets, b, k, self.__dict__.get("_seed_bases"))

    def __iter__(self) -> Iterator[Batch]:
        return self.iter_batches(0, len(self))

    def iter_batches(self, lo: int, hi: int) -> Iterator[Batch]:
        """Batches ``lo .. hi - 1`` in order, computed in blocks of about 64K entries (one
        permutation pass each)."""
        block = max(1, 65536 // max(self.batch_size, 1))
        for start in range(lo, hi, block):
            yield from self.batches(start, min(start + block, hi))

    def batches(self, lo: int, hi: int, step: int = 1) -> list[Batch]:
        """Batches ``range(lo, hi, step)``, equal to ``[self[i] for i in range(lo, hi, step)]``,
        computed together: one pass of the permutation for all their entries (a batch alone
        pays numpy's fixed cost per operation, several hundred microseconds). O(their entries)."""
        idx = np.arange(max(0, int(lo)), min(len(self), int(hi)), max(1, int(step)), dtype=np.int64)
        if not idx.size:
            return []
        steps = self.batch_step[idx]
        sizes = self.offsets[idx + 1] - self.offsets[idx]
        before = np.cumsum(sizes) - sizes
        what = f"batch {int(idx[0])}" if idx.size == 1 else f"batches {int(idx[0])}..{int(idx[-1])}"
        samples, pad, seeds = _within_memory(lambda: self._seeded(*self._entry_keys(steps, sizes, before)),
                                             int(sizes.sum()), what)
        packs = None if self.packs is None else self.packs.numbers(self.schedule[steps], self.window[steps], sizes)
        out = []
        table, names, epoch = self.bucket_table, self.datasets, self.epoch
        new = object.__new__  # the fields are computed here: skip the frozen __init__'s setattr per field
        for i, st, t, at, size in zip(idx.tolist(), steps.tolist(), self.schedule[steps].tolist(), before.tolist(),
                                      sizes.tolist()):
            ds, key = table[t]
            b = new(Batch)
            b.__dict__.update(epoch=epoch, step=st, index=i, dataset=names[ds], bucket=key,
                              samples=samples[at : at + size], pad=pad[at : at + size],
                              pack=None if packs is None else packs[at : at + size],
                              seeds=None if seeds is None else seeds[at : at + size])
            out.append(b)
        return out

    def _all(self) -> tuple[np.ndarray, np.ndarray]:
        cached = self.__dict__.get("_entries")
        if cached is None:
            keys = (self.batch_step, np.diff(self.offsets), self.offsets[:-1])
            cached = _within_memory(lambda: self.buckets.entries(*self._entry_keys(*keys)), int(self.offsets[-1]),
                                    "this rank's share")
            self.__dict__["_entries"] = cached
        return cached

    @property
    def samples(self) -> np.ndarray:
        """Every sample id of this rank's epoch, in batch order (batch i is
        ``samples[offsets[i]:offsets[i + 1]]``); computed on first use, O(share)."""
        return self._all()[0]

    @property
    def pad(self) -> np.ndarray:
        """The padded-copy flags parallel to :attr:`samples`."""
        return self._all()[1]


class EntryOrder(Protocol):
    """Where a rank's entries come from: the keyed global order (``Buckets``), a
    shard-local order (core/local/localbuckets.py), a budget's strata (core/budgets/budgetplan.py) or an
    elastic remainder of one of them (core/elastic/remainder.py)."""

    def entries(self, b: np.ndarray, k: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(sample ids, padded flags) of this rank's entries ``k`` of kept buckets ``b``."""
        ...


class Buckets:
    """The kept buckets' facts a rank's entries are computed from: O(buckets).

    Entry k of kept bucket b on dp_rank d is global position p = d + k * dp_size; it
    holds pass ``(p mod m) // n`` at place ``perm_pass((p mod m) mod n)`` of the
    bucket's sorted ids, and is a padded copy iff p >= m (n samples, m = n * passes).
    ``order`` is where entries come from (this keyed order unless another is given),
    ``local`` the shard-local order whose shard uses readers plan from (or None), both
    fixed when the buckets are made.
    """

    def __init__(self, kept: Sequence[tuple[Any, int, int, list[list[int]]]], dp: int, d: int, *,
                 counts: np.ndarray, order: EntryOrder | None = None, local: Any = None) -> None:
        self.ids = [k[0] for k in kept]
        self.n = np.asarray([k[1] for k in kept], dtype=np.int64)
        self.m = np.asarray([k[2] for k in kept], dtype=np.int64)
        self.key_rows = np.asarray([row for k in kept for row in k[3]], dtype=np.uint64).reshape(-1, ROUNDS)
        self.first_row = np.zeros(len(kept), dtype=np.int64)
        np.cumsum([len(k[3]) for k in kept][:-1], out=self.first_row[1:])
        self.dp, self.d = dp, d
        self.local: Any = local  # a LocalBuckets (core/local/localbuckets.py) or a remainder of one, or None
        self.order: EntryOrder = order if order is not None else local if local is not None else self
        self.counts = counts  # entries of this rank per kept bucket

    def entries(self, b: np.ndarray, k: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(sample ids, padded flags) of entries ``k`` of kept buckets ``b`` (parallel arrays)."""
        if self.order is not self:
            return self.order.entries(b, k)
        return self.at(b, rank_position(self.d, k, self.dp))

    def at(self, b: np.ndarray, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(sample ids, padded flags) at global positions ``pos`` of kept buckets ``b``, whatever
        the rank (the elastic remainder of an epoch reads the whole layout's order)."""
        if self.local is not None:
            return self.local.at(b, pos)
        if not pos.size:
            return np.zeros(0, np.int64), np.zeros(0, bool)
        m_e = self.m[b]
        n_e = self.n[b]
        q = pos % m_e
        pass_idx = q // n_e
        keys = self.key_rows[self.first_row[b] + pass_idx].T
        perm = permute(q % n_e, n_e, keys)
        samples = np.empty(pos.size, dtype=np.int64)
        if np.all(b == b[0]):  # one batch: one bucket
            samples[:] = self.ids[int(b[0])][perm]
        else:
            order = np.argsort(b, kind="stable")
            bounds = np.searchsorted(b[order], np.arange(len(self.ids) + 1))
            for j, ids in enumerate(self.ids):
                lo, hi = int(bounds[j]), int(bounds[j + 1])
                if hi > lo:
                    sel = order[lo:hi]
                    samples[sel] = ids[perm[sel]]
        return samples, pos >= m_e

    def copies(self, b: np.ndarray, k: np.ndarray) -> np.ndarray | None:
        """Copy numbers of entries ``k`` of kept buckets ``b`` in the keyed order (``p // n``,
        core/sampleseed.py)."""
        return self.positions(b, rank_position(self.d, np.asarray(k, np.int64), self.dp))

    def positions(self, b: np.ndarray, pos: np.ndarray) -> np.ndarray | None:
        """Copy numbers at global positions ``pos`` of kept buckets ``b`` (None: a local order)."""
        if self.local is not None:
            return None
        return np.asarray(pos, np.int64) // np.maximum(self.n[np.asarray(b, np.int64)], 1)


class Bins:
    """Where each batch of each kept bucket starts among a rank's entries of that bucket,
    when batches are not ``batch_size`` entries each (a budget): batch w of kept bucket b
    is entries ``[start(b, w), start(b, w + 1))``. O(the rank's batches)."""

    def __init__(self, starts: Sequence[np.ndarray]) -> None:
        sizes = np.asarray([len(x) for x in starts], np.int64)
        self.base = np.zeros(len(starts), np.int64)
        np.cumsum(sizes[:-1], out=self.base[1:])
        self.flat = np.concatenate([np.asarray(x, np.int64) for x in starts]) if starts else np.zeros(0, np.int64)

    def start(self, b: np.ndarray, w: np.ndarray) -> np.ndarray:
        return self.flat[self.base[np.asarray(b, np.int64)] + np.asarray(w, np.int64)]

    @property
    def widest(self) -> int:
        """The plan's ``batch_size`` under them: the widest batch (at least 1)."""
        return max(1, int(np.diff(self.flat).max(initial=1)) if self.flat.size > 1 else 1)


def rank_batches(counts: np.ndarray, bucket_steps: Sequence[int], schedule: np.ndarray, window: np.ndarray,
                  bs: int, bins: Bins | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(batch_step, offsets) of a rank with ``counts`` entries per kept bucket: its batch for
    global step s is its entries [k*bs, (k+1)*bs) of bucket schedule[s], k = window[s]
    (with ``bins``: [bins.start(b, k), bins.start(b, k + 1)))."""
    step_dtype = np.int32 if schedule.size < 2**31 else np.int64
    if bins is None and np.array_equal(counts, np.asarray(bucket_steps, dtype=np.int64) * bs):
        # every bucket fills whole global steps (cyclic, drop, or lengths that happen to
        # divide): this rank has a full batch at every step; nothing per step to compute
        return np.arange(schedule.size, dtype=step_dtype), np.arange(schedule.size + 1, dtype=np.int64) * bs
    if not schedule.size:
        sizes = np.zeros(0, np.int64)
    elif bins is not None:
        sched, win = schedule.astype(np.int64), window.astype(np.int64)
        sizes = np.maximum(np.minimum(bins.start(sched, win + 1), counts[sched]) - bins.start(sched, win), 0)
    else:
        sizes = np.clip(counts[schedule] - window.astype(np.int64) * bs, 0, bs)
    has = sizes > 0
    batch_step = np.flatnonzero(has).astype(step_dtype)
    offsets = np.zeros(batch_step.size + 1, dtype=np.int64)
    np.cumsum(sizes[has], out=offsets[1:])
    return batch_step, offsets


def _within_memory(compute: Any, entries: int, what: str) -> Any:
    """``compute()``, with a MemoryError (below the planner's limit, but more than this
    machine holds) turned into a ConfigError that says what to lower."""
    try:
        return compute()  # type: ignore[no-any-return]
    except MemoryError as exc:
        raise ConfigError(
            f"{what} holds {entries} planned entries, more than this machine can allocate "
            f"(about {entries * 64 / 2**30:.1f} GiB); lower the batch size, plan on more DP ranks, "
            "or turn oversubscribe off"
        ) from exc
