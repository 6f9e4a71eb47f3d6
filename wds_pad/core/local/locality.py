"""Shard locality: how a bucket's global order is drawn when ``locality="shard"``.

With ``locality="none"`` every bucket is one keyed permutation over all of its samples
(core/planning/plan.py): one ranged read per sample. With ``locality="shard"`` the order is
drawn so that a DP rank reads its samples from a few whole shards:

1. each epoch, a dataset's shards are shuffled from (seed, epoch, dataset) and dealt to
   the DP ranks as contiguous runs of that order, balanced by bytes (each rank within one
   shard of ``total / dp_size``); the run is also the order in which the rank visits them;
2. a rank's shards are cut into windows of ``window`` shards. A window's "pool" of a
   bucket is that bucket's samples in its shards (1 + repeats passes, each shuffled by
   one keyed permutation per window and pass). A rank's own entries of the bucket are
   its windows' pools one after another, in visit order (first in, first out): its
   entry j is entry j of that sequence, and what is left past the rank's need is its
   surplus. Window w also gets a span of the epoch's global steps, its share of the
   rank's samples: the time the reader holds w's shards (core/local/shardschedule.py
   ``shard_reads``). A bucket whose steps run ahead of its samples there reads the
   next window's pool early (the reader fetches that shard early, while it fits); one
   that runs behind reads the previous window's pool late (from the bytes the reader
   keeps of it). First in, first out keeps those lags as short as the counts allow;
3. bucket b needs ``r_d`` real entries on rank d (the positions ``d + k * dp_size`` below
   the bucket's unpadded length, exactly as for ``none``) while the rank owns ``o_d``
   entries of it. A rank with ``o_d > r_d`` keeps its first ``r_d`` and gives the rest
   away; a rank short of its share receives ``r_d - o_d`` "foreign" entries: surpluses
   and deficits are matched in rank order, so the foreign count is
   ``sum(max(0, r_d - o_d))``, the fewest that make every share equal (what ``drop``
   truncates is surplus nobody needs). Foreign entries are spread evenly through the
   rank's entries of the bucket;
4. padded copies (positions past the unpadded length) are, as for ``none``, the entries
   at the front of the bucket's global order: global position p holds rank
   ``p mod dp_size``'s entry ``p // dp_size``.

So the global order of a bucket is a permutation of its entries (each sample 1 + repeats
times) and everything after it — padding, the split across ranks, the epoch schedule —
is the code of ``none``: invariants 1-7 hold unchanged. Everything is integer numpy
arithmetic on keys from :func:`~wds_pad.core.seed.derive_seed` (invariant 4).

Cost: setting up an epoch is O(shards + buckets x (windows + dp)) per rank plus,
per bucket, O(min(its rows, shards x log(rows))) time and O(the shards holding its
samples) memory: a bucket keeps only those shards, in visit order (found by a scan of its
rows in an index's shard column, whose rows are grouped by bucket and then shard, or by a
binary search per shard where the bucket is large; a plain Dataset with a shard map
sorts each bucket once, O(samples)); a batch costs O(batch size x log(shards)). The shard cache's schedule
(core/local/shardschedule.py ``shard_reads``) costs O(the rank's share) per epoch.

The planner needs each sample's shard: an Index (``shard`` column and shard table) or a
:class:`ShardMap` around a Dataset. Anything else is a ConfigError that names the fix.

This module holds the choice (``Locality``), the shard maps and step 1; steps 2-4 are
core/local/localbuckets.py's.

Invariants:
- each epoch every shard of a dataset is dealt to exactly one DP rank, as a contiguous
  run of the shuffled order, each rank within one shard of ``total bytes / dp_size``;
- the deal and the windows depend on (seed, epoch, dataset, shard sizes, dp_size,
  window) only (with nodes, a node's export tail also on its buckets' counts per shard,
  which do not depend on the epoch): identical on every rank, and CP peers read the
  same shards;
- an input without each sample's shard is a ConfigError that names the fix.
"""


from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any, Sequence

import numpy as np

from ...errors import ConfigError
from ..dataset import Dataset, max_id
from ..seed import derive_rng

__all__ = ["Locality", "ShardMap", "shard_map_of"]

class Locality(str, Enum):
    """How a bucket's global order is drawn: ``none`` (all shards), ``shard`` (each epoch's
    shards dealt to the DP ranks) or ``node`` (shards dealt to nodes for good, each
    epoch's order on a node shared by its ranks)."""

    NONE = "none"
    SHARD = "shard"
    NODE = "node"

    @property
    def dealt(self) -> bool:
        """Whether shards are dealt (to ranks or nodes): each sample's shard is needed."""
        return self is not Locality.NONE


@dataclass(frozen=True, eq=False)
class ShardMap:
    """A Dataset with the shard of every sample, for ``locality="shard"``.

    Args:
        dataset: the Dataset.
        shard: int array indexed by sample id: the shard number (0 <= shard < shards).
        shard_bytes: bytes of each shard (balances the deal); None: its sample count.
        grouped: the rows of each ``IdRange`` bucket are already in shard order (an
            index's are), so a bucket's per-shard counts are binary searches.
    """

    dataset: Dataset
    shard: Any
    shard_bytes: Any = None
    grouped: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.dataset, Dataset):
            raise ConfigError(f"ShardMap.dataset must be a Dataset, got {type(self.dataset).__name__}")
        sh = self.shard if self.grouped else np.asarray(self.shard)
        if sh.ndim != 1 or (sh.size and (not np.issubdtype(sh.dtype, np.integer)
                                         or (not self.grouped and sh.min() < 0))):
            raise ConfigError("ShardMap.shard must be a 1-D array of shard numbers >= 0, indexed by sample id")
        object.__setattr__(self, "shard", sh)
        top = max((max_id(ids) for ids in self.dataset.buckets.values()), default=-1)
        if top >= sh.size:
            raise ConfigError(f"ShardMap.shard has {sh.size} entries but dataset {self.dataset.name!r} "
                              f"holds sample id {top}; give one shard number per sample id")
        if self.shard_bytes is not None:
            sb = np.asarray(self.shard_bytes, dtype=np.int64)
            if sb.ndim != 1 or (sh.size and sb.size <= int(sh.max())) or (sb.size and sb.min() < 0):
                raise ConfigError("ShardMap.shard_bytes must give a size >= 0 for every shard number")
            object.__setattr__(self, "shard_bytes", sb)

    @property
    def name(self) -> str:
        return self.dataset.name

    def to_dataset(self) -> Dataset:
        """The Dataset (so the planner takes a ShardMap wherever it takes a Dataset)."""
        return self.dataset


@dataclass(frozen=True)
class _Layout:
    shard: Any               # sample id -> shard number (memory-mapped for an index)
    shard_bytes: np.ndarray  # per shard
    grouped: bool            # each IdRange bucket's rows are already in shard order


def layouts(raw: Sequence[Any], dss: Sequence[Dataset]) -> list[_Layout]:
    """The shard layout of every planned input (an Index or a ShardMap), in input order.

    Raises:
        ConfigError: an input without a shard map.
    """
    out = []
    for item, ds in zip(raw, dss):
        if isinstance(item, ShardMap):
            sh = item.shard
            if item.shard_bytes is not None:
                sb = item.shard_bytes
            else:
                sb = np.bincount(sh, minlength=int(sh.max()) + 1 if sh.size else 0)
            out.append(_Layout(sh, np.asarray(sb, dtype=np.int64), item.grouped))
        elif hasattr(item, "to_dataset") and hasattr(item, "shard") and hasattr(item, "shards"):
            sizes = np.asarray([max(int(s.size), 0) for s in item.shards], dtype=np.int64)
            out.append(_Layout(item.shard, sizes, True))
        else:
            raise ConfigError(
                f"locality='shard' needs each sample's shard, and dataset {ds.name!r} is a "
                f"{type(item).__name__} without one: plan an Index (wds_pad.load_index), or wrap the "
                "Dataset as wds_pad.ShardMap(dataset, shard=<shard number per sample id>), or use "
                "locality='none'"
            )
    return out


class DealtDataset:
    """One dataset's shard deal and windows for an epoch: identical on every rank.

    The shards are dealt to ``owners``: the DP ranks (``locality="shard"``: a new deal
    every epoch) or the nodes (``locality="node"``: the deal is the same every epoch, so a
    node's shards stay on it). With nodes, a node's last shards of the deal (its "export"
    tail: at least ``EXPORT``, and as many as hold every bucket's surplus, see
    :meth:`set_tails`) stay last, in the same order, in windows of their own; each epoch
    only the order the node visits its other shards changes. So what a node gives away to
    keep the buckets' shares equal comes from the same shards every epoch.
    """

    def __init__(self, layout: _Layout, name: str, seed: int, epoch: int, owners: int, window: int,
                 stable: bool = False) -> None:
        s = int(layout.shard_bytes.size)
        parts = (name, "locality", "node-deal") if stable else (epoch, name, "locality", "deal")
        self.visit = derive_rng(seed, *parts).permutation(s).astype(np.int64)
        weight = layout.shard_bytes[self.visit] if s else np.zeros(0, np.int64)
        if s and int(weight.sum()) == 0:
            weight = np.ones(s, np.int64)
        before = np.zeros(s, np.int64)
        if s:
            np.cumsum(weight[:-1], out=before[1:])
        total = int(weight.sum())
        # owner d owns the shards whose byte midpoint falls in [total*d/owners, total*(d+1)/owners)
        thresholds = np.asarray([-(-2 * total * d // owners) for d in range(owners)], dtype=np.int64)
        owner = np.searchsorted(thresholds, 2 * before + weight, side="right") - 1 if s else np.zeros(0, np.int64)
        self.rank_start = np.searchsorted(owner, np.arange(owners + 1), side="left").astype(np.int64)
        self.visit_pos = np.empty(s, np.int64)  # shard number -> its visit position
        self.visit_pos[self.visit] = np.arange(s, dtype=np.int64)
        self.deal_pos = self.visit_pos.copy()  # shard number -> its place in the deal (the same every epoch with nodes)
        self.layout, self.stable, self.window = layout, stable, window
        self._key = (seed, epoch, name)
        if not stable:
            self._windows(np.zeros(owners, np.int64))

    def set_tails(self, required: np.ndarray) -> None:
        """With nodes: node d's export tail is its last ``max(EXPORT, required[d])`` shards
        of the deal (at most all of them), visited last in the deal's order, in windows of
        ``max(window, EXPORT)`` shards; its other shards are visited in an order of the epoch.

        Args:
            required: per node, the fewest last shards of its deal that hold every
                bucket's surplus (:func:`tail_needed`); depends on the deal only.
        """
        seed, epoch, name = self._key
        per_rank = np.diff(self.rank_start)
        tail = np.minimum(per_rank, np.maximum(np.asarray(required, np.int64), EXPORT))
        for d in range(per_rank.size):  # this epoch's visit order inside each node; its tail stays last
            lo, cut = int(self.rank_start[d]), int(self.rank_start[d + 1] - tail[d])
            if cut - lo > 1:
                order = derive_rng(seed, epoch, name, d, "locality", "visit").permutation(cut - lo)
                self.visit[lo:cut] = self.visit[lo:cut][order]
        self.visit_pos[self.visit] = np.arange(self.visit.size, dtype=np.int64)
        self._windows(tail)

    def _windows(self, tail: np.ndarray) -> None:
        """Cut each owner's visit order into windows: ``window`` shards at a time, then its
        ``tail`` shards in windows of ``max(window, EXPORT)``."""
        per_rank = np.diff(self.rank_start)
        span = max(self.window, EXPORT)
        head_n = -(-(per_rank - tail) // self.window)
        nwin = head_n + -(-tail // span)
        self.win_base = np.zeros(per_rank.size + 1, np.int64)
        np.cumsum(nwin, out=self.win_base[1:])
        self.tail_base = self.win_base[:-1] + head_n  # each owner's first window of its tail
        # visit position where each global window starts (plus the end)
        starts = [np.concatenate([self.rank_start[d] + self.window * np.arange(int(head_n[d]), dtype=np.int64),
                                  self.rank_start[d + 1] - tail[d] + span * np.arange(int(nwin[d] - head_n[d]),
                                                                                      dtype=np.int64)])
                  for d in range(per_rank.size)]
        self.win_start = np.concatenate(starts + [np.asarray([self.visit.size], np.int64)]).astype(np.int64)
        self.rank_of = np.repeat(np.arange(per_rank.size, dtype=np.int64), nwin)  # owner of each global window


def tail_needed(dealt: DealtDataset, shard: np.ndarray, count: np.ndarray, surplus: np.ndarray,
                passes: int) -> np.ndarray:
    """Per owner, the fewest of its last shards in the deal that hold ``surplus[d]``
    entries of one bucket (``count`` samples in each of ``shard``, ``passes`` entries a
    sample): a node whose tail holds them gives its surplus from the same shards every epoch.
    O(the bucket's shards)."""
    out = np.zeros(surplus.size, np.int64)
    short = np.flatnonzero(surplus > 0)
    if not short.size:
        return out
    pos = dealt.deal_pos[shard]
    o = np.argsort(pos, kind="stable")
    pos, cum = pos[o], np.zeros(o.size + 1, np.int64)
    np.cumsum(count[o], out=cum[1:])
    end = cum[np.searchsorted(pos, dealt.rank_start[short + 1], side="left")]  # samples up to the node's end
    want = -(-surplus[short] // passes)
    i = np.searchsorted(cum, end - want, side="right") - 1  # the last shard from which the rest holds them
    out[short] = dealt.rank_start[short + 1] - pos[np.minimum(i, pos.size - 1)]
    return out


#: The fewest shards a node visits last every epoch, in windows of their own, with
#: ``locality="node"`` (more where a bucket's surplus needs them): what it gives to other
#: nodes to keep the buckets' shares equal comes from them, the same shards every epoch,
#: so the receiving node can keep them.
EXPORT = 4


def shard_map_of(index: Any, dataset: Dataset) -> ShardMap:
    """``dataset`` (an index's ``to_dataset()``) with that index's shard column and shard
    sizes: what ``locality="shard"`` plans from (duck-typed: the planner imports no I/O)."""
    sizes = np.asarray([max(int(s.size), 0) for s in index.shards], dtype=np.int64)
    return ShardMap(dataset, index.shard, shard_bytes=sizes, grouped=True)
