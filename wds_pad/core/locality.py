"""Shard locality: how a bucket's global order is drawn when ``locality="shard"``.

With ``locality="none"`` every bucket is one keyed permutation over all of its samples
(core/plan.py): one ranged read per sample. With ``locality="shard"`` the order is
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
   rank's samples: the time the reader holds w's shards (core/shardschedule.py
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
(core/shardschedule.py ``shard_reads``) costs O(the rank's share) per epoch.

The planner needs each sample's shard: an Index (``shard`` column and shard table) or a
:class:`ShardMap` around a Dataset. Anything else is a ConfigError that names the fix.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any, Hashable, Sequence

import numpy as np

from ..errors import ConfigError
from .dataset import Dataset, IdRange
from .permute import ROUNDS, _mix, permute
from .seed import derive_rng, derive_seed

__all__ = ["Locality", "LocalityFigures", "ShardMap", "figures", "shard_map_of"]

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_SCAN_FACTOR = 4  # a bucket of up to 4 x shards rows finds its shards by one scan of its rows


class Locality(str, Enum):
    """How a bucket's global order is drawn: ``none`` (all shards) or ``shard`` (per rank)."""

    NONE = "none"
    SHARD = "shard"


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
        top = max((_max_id(ids) for ids in self.dataset.buckets.values()), default=-1)
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


def _max_id(ids: Any) -> int:
    if isinstance(ids, IdRange):
        return ids.stop - 1
    return int(ids[-1]) if ids.size else -1


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


def _window_keys(base: int, idx: np.ndarray) -> np.ndarray:
    """Round keys (ROUNDS, len(idx)) of the permutations ``idx`` of one bucket: the numpy
    image of ``round_keys(mix(base + (idx + 1) * golden))``, bitwise on every machine."""
    with np.errstate(over="ignore"):
        key = _mix(np.uint64(base) + (idx.astype(np.uint64) + np.uint64(1)) * _GOLDEN)
        return np.stack([_mix(key + np.uint64(i + 1) * _GOLDEN) for i in range(ROUNDS)])


def _floor_mul_div(k: np.ndarray, f: np.ndarray, r: np.ndarray) -> np.ndarray:
    """``k * f // r`` exactly (int64 when it cannot overflow, Python ints otherwise)."""
    if k.size and int(k.max()) * int(f.max()) >= 2**62:
        return np.asarray([a * b // c for a, b, c in zip(k.tolist(), f.tolist(), r.tolist())], dtype=np.int64)
    return k * f // np.maximum(r, 1)


class _DealtDataset:
    """One dataset's shard deal and windows for an epoch: identical on every rank."""

    def __init__(self, layout: _Layout, name: str, seed: int, epoch: int, dp: int, window: int) -> None:
        s = int(layout.shard_bytes.size)
        self.visit = derive_rng(seed, epoch, name, "locality", "deal").permutation(s).astype(np.int64)
        weight = layout.shard_bytes[self.visit] if s else np.zeros(0, np.int64)
        if s and int(weight.sum()) == 0:
            weight = np.ones(s, np.int64)
        before = np.zeros(s, np.int64)
        if s:
            np.cumsum(weight[:-1], out=before[1:])
        total = int(weight.sum())
        # rank d owns the shards whose byte midpoint falls in [total*d/dp, total*(d+1)/dp)
        thresholds = np.asarray([-(-2 * total * d // dp) for d in range(dp)], dtype=np.int64)
        owner = np.searchsorted(thresholds, 2 * before + weight, side="right") - 1 if s else np.zeros(0, np.int64)
        self.rank_start = np.searchsorted(owner, np.arange(dp + 1), side="left").astype(np.int64)
        per_rank = np.diff(self.rank_start)
        nwin = -(-per_rank // window)
        self.win_base = np.zeros(dp + 1, np.int64)
        np.cumsum(nwin, out=self.win_base[1:])
        # visit position where each global window starts (plus the end)
        starts = [self.rank_start[d] + window * np.arange(int(nwin[d]), dtype=np.int64) for d in range(dp)]
        self.win_start = np.concatenate(starts + [np.asarray([s], np.int64)]).astype(np.int64)
        self.visit_pos = np.empty(s, np.int64)  # shard number -> its visit position
        self.visit_pos[self.visit] = np.arange(s, dtype=np.int64)
        self.rank_of = np.repeat(np.arange(dp, dtype=np.int64), nwin)  # rank of each global window
        self.layout = layout


def _runs(of: np.ndarray, s: int, scan: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(shard, first row, rows) of each run of equal shard numbers in the sorted ``of``.

    O(min(rows, shards x log rows)): a scan of the rows where they are few (or ``scan``:
    already in memory), else a binary search per shard number (an index's memory-mapped
    column is then read at O(shards) places, not in full).

    Raises:
        ConfigError: a shard number outside [0, s).
    """
    n = int(of.size)
    if n and (int(of[0]) < 0 or int(of[-1]) >= s):
        bad = int(of[0]) if int(of[0]) < 0 else int(of[-1])
        raise ConfigError(f"a sample's shard number {bad} is outside the {s} shards of its map "
                          f"(expected 0 <= shard < {s}): give shard_bytes for every shard number")
    if scan or n <= _SCAN_FACTOR * s:
        first = np.flatnonzero(np.r_[n > 0, of[1:] != of[:-1]]) if n else np.zeros(0, np.int64)
        first = first.astype(np.int64)
        shard = np.asarray(of[first], dtype=np.int64)
    else:
        start = np.searchsorted(of, np.arange(s + 1), side="left").astype(np.int64)
        shard = np.flatnonzero(np.diff(start)).astype(np.int64)
        first = start[shard]
    counts = np.diff(np.append(first, n)).astype(np.int64)
    return shard, first, counts


def _narrow(a: np.ndarray, top: int) -> np.ndarray:
    """``a`` (values in [0, top]) as int32 where it fits: the sparse tables are O(samples)."""
    return a.astype(np.int32) if top < 2**31 - 1 else a.astype(np.int64)


class _LocalBucket:
    """Kept bucket b's per-shard, per-window and per-rank counts (see the module doc).

    The per-shard table is sparse: only the shards holding samples of b, in visit order (``v_pos``, their
    first row ``v_row`` in ``sorted_ids``, the samples before each ``v_cum``), so a bucket
    costs O(its shards), not O(shards); the per-window and per-rank tables are dense.
    """

    def __init__(self, dealt: _DealtDataset, ids: Any, passes: int, m: int, length: int,
                 dp: int, base_key: int) -> None:
        sh, s = dealt.layout.shard, int(dealt.layout.shard_bytes.size)
        if isinstance(ids, IdRange) and dealt.layout.grouped:
            self.sorted_ids = ids
            nz_shard, nz_start, nz_count = _runs(np.asarray(sh[ids.start:ids.stop]), s)
        else:
            arr = np.asarray(ids, dtype=np.int64)
            of = np.asarray(sh[arr])
            order = np.argsort(of, kind="stable")
            self.sorted_ids = arr[order]
            nz_shard, nz_start, nz_count = _runs(of[order], s, scan=True)
        vis = dealt.visit_pos[nz_shard]
        o = np.argsort(vis, kind="stable")
        self.v_pos = _narrow(vis[o], s)                    # visit positions holding samples of b
        self.v_row = _narrow(nz_start[o], self.sorted_ids.size)  # their first row in sorted_ids
        self.v_cum = np.zeros(o.size + 1, np.int64)        # samples before each of them
        np.cumsum(nz_count[o], out=self.v_cum[1:])
        self.v_cum = _narrow(self.v_cum, self.sorted_ids.size)
        self.win_cum = self._cum_at(dealt.win_start)       # samples before each global window
        own = np.diff(self._cum_at(dealt.rank_start)) * passes
        real = min(m, length)
        d = np.arange(dp, dtype=np.int64)
        self.need = np.maximum(0, -(-(real - d) // dp))
        self.own = own
        self.keep = np.minimum(own, self.need)            # own entries a rank yields itself
        self.surplus_cum = np.zeros(dp + 1, np.int64)
        np.cumsum(np.maximum(own - self.need, 0), out=self.surplus_cum[1:])
        self.deficit = np.maximum(self.need - own, 0)
        self.deficit_cum = np.zeros(dp + 1, np.int64)
        np.cumsum(self.deficit, out=self.deficit_cum[1:])
        self.passes, self.m, self.base_key, self.dealt, self.dp = passes, m, base_key, dealt, dp

    def _cum_at(self, vpos: np.ndarray) -> np.ndarray:
        """Samples of b at visit positions before each of ``vpos`` (int64)."""
        return self.v_cum[np.searchsorted(self.v_pos, vpos, side="left")].astype(np.int64)

    @property
    def win_samples(self) -> np.ndarray:
        """Samples of b in each global window's shards."""
        return np.diff(self.win_cum)

    @property
    def pool(self) -> np.ndarray:
        """Entries of b each global window's shards hold (every pass)."""
        return self.win_samples * self.passes

    @property
    def rank_of(self) -> np.ndarray:
        """The rank of each global window."""
        return self.dealt.rank_of

    def _pool_entries(self, g: np.ndarray, u: np.ndarray) -> np.ndarray:
        """Sample ids of pool entries u of global windows g: pass-major, shuffled per pass."""
        first = self.win_cum[g]
        n_w = self.win_cum[g + 1] - first
        pass_idx = u // n_w
        t = permute(u % n_w, n_w, _window_keys(self.base_key, g * self.passes + pass_idx))
        vpos = first + t                                   # the entry's place among b's samples, visit order
        i = np.searchsorted(self.v_cum, vpos, side="right") - 1
        rows = self.v_row[i].astype(np.int64) + (vpos - self.v_cum[i].astype(np.int64))
        return np.asarray(self.sorted_ids[rows], dtype=np.int64)

    def own_entries(self, d: np.ndarray, j: np.ndarray) -> np.ndarray:
        """Sample ids of rank d's own entries j (j >= keep[d]: its surplus, given away):
        its windows' pools one after another, in visit order (first in, first out)."""
        supply = self.win_cum.astype(np.int64) * self.passes   # pool entries before each window
        pos = supply[self.dealt.win_base[d]] + j
        g = np.searchsorted(supply, pos, side="right") - 1
        return self._pool_entries(g, pos - supply[g])

    def rank_entries(self, d: np.ndarray, k: np.ndarray) -> np.ndarray:
        """Sample ids of entries k of ranks d, k < need[d]: own ones with foreign spread in."""
        r, f = self.need[d], self.deficit[d]
        before = _floor_mul_div(k, f, r)
        foreign = _floor_mul_div(k + 1, f, r) > before
        out = np.empty(k.size, np.int64)
        mine = ~foreign
        if mine.any():
            out[mine] = self.own_entries(d[mine], (k - before)[mine])
        if foreign.any():
            gd = self.deficit_cum[d[foreign]] + before[foreign]
            giver = np.searchsorted(self.surplus_cum, gd, side="right") - 1
            out[foreign] = self.own_entries(giver, self.keep[giver] + gd - self.surplus_cum[giver])
        return out

    def entries(self, pos: np.ndarray, dp: int) -> np.ndarray:
        """Sample ids at global positions ``pos`` (padded ones wrap to the front)."""
        q = pos % self.m
        return self.rank_entries(q % dp, q // dp)


class LocalBuckets:
    """The kept buckets of a shard-local plan: what ``Plan`` computes entries from."""

    def __init__(self, raw: Sequence[Any], dss: Sequence[Dataset],
                 kept: Sequence[tuple[int, Hashable, Any, int, int, int]],
                 seed: int, epoch: int, dp: int, d: int, window: int,
                 schedule: np.ndarray, batch_size: int) -> None:
        lays = layouts(raw, dss)
        self.dealt = [_DealtDataset(lay, ds.name, seed, epoch, dp, window) for lay, ds in zip(lays, dss)]
        self.buckets = [
            _LocalBucket(self.dealt[di], ids, passes, n * passes, length, dp,
                         derive_seed(seed, epoch, dss[di].name, key, "window"))
            for di, key, ids, n, passes, length in kept]
        self.kept_dataset = [k[0] for k in kept]
        self.dp, self.d, self.window = dp, d, window
        total = int(schedule.size)
        self.win_step: list[np.ndarray] = []
        for di, dealt in enumerate(self.dealt):
            mine = [bk for bk, kd in zip(self.buckets, self.kept_dataset) if kd == di]
            # a window's step span: its share of its rank's samples (every bucket), in steps
            samples = np.zeros(dealt.win_start.size - 1, np.int64)
            for bk in mine:
                samples += bk.win_samples
            gw = samples.size
            rank_of = dealt.rank_of
            before = np.zeros(gw + 1, np.int64)
            np.cumsum(samples, out=before[1:])
            rank_total = before[dealt.win_base[1:]] - before[dealt.win_base[:-1]]
            in_rank = before[:-1] - before[dealt.win_base[:-1]][rank_of]
            step = np.where(rank_total[rank_of] > 0, in_rank * total // np.maximum(rank_total[rank_of], 1), 0)
            self.win_step.append(np.append(step, total).astype(np.int64))

    def entries(self, b: np.ndarray, k: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(sample ids, padded flags) of entries ``k`` of kept buckets ``b`` of this rank."""
        return self.at(b, self.d + self.dp * np.asarray(k, np.int64))

    def at(self, b: np.ndarray, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(sample ids, padded flags) at global positions ``pos`` of kept buckets ``b``."""
        if not pos.size:
            return np.zeros(0, np.int64), np.zeros(0, bool)
        samples = np.empty(pos.size, np.int64)
        pad = np.empty(pos.size, bool)
        for j in np.unique(b).tolist():
            sel = np.flatnonzero(b == j)
            bk = self.buckets[j]
            samples[sel] = bk.entries(pos[sel], self.dp)
            pad[sel] = pos[sel] >= bk.m
        return samples, pad

    # -- facts for summaries (pure) ----------------------------------------------------
    def rank_shards(self, di: int, d: int | None = None) -> np.ndarray:
        """Shard numbers of dataset ``di`` dealt to rank d (default: this rank), in visit order."""
        dealt = self.dealt[di]
        d = self.d if d is None else d
        return dealt.visit[dealt.rank_start[d]:dealt.rank_start[d + 1]]

    def foreign(self, d: int | None = None) -> int:
        """Foreign entries of rank d (default: this rank) over every kept bucket."""
        d = self.d if d is None else d
        return int(sum(int(bk.deficit[d]) for bk in self.buckets))

    def window_of_step(self, di: int, steps: np.ndarray, d: int | None = None) -> np.ndarray:
        """Rank d's window (0, 1, ... in its visit order) whose step span holds each step."""
        d = self.d if d is None else d
        dealt = self.dealt[di]
        lo, hi = int(dealt.win_base[d]), int(dealt.win_base[d + 1])
        if hi == lo:
            return np.full(np.asarray(steps).shape, -1, np.int64)
        return np.searchsorted(self.win_step[di][lo:hi], steps, side="right") - 1

    def is_foreign(self, b: int, k: np.ndarray, d: int | None = None) -> np.ndarray:
        """Whether entries k (real, not padded) of kept bucket b on rank d are foreign."""
        d = self.d if d is None else d
        bk = self.buckets[b]
        dd = np.full(k.size, d, np.int64)
        r, f = bk.need[dd], bk.deficit[dd]
        return _floor_mul_div(k + 1, f, r) > _floor_mul_div(k, f, r)


def shard_map_of(index: Any, dataset: Dataset) -> ShardMap:
    """``dataset`` (an index's ``to_dataset()``) with that index's shard column and shard
    sizes: what ``locality="shard"`` plans from (duck-typed: the planner imports no I/O)."""
    sizes = np.asarray([max(int(s.size), 0) for s in index.shards], dtype=np.int64)
    return ShardMap(dataset, index.shard, shard_bytes=sizes, grouped=True)


@dataclass(frozen=True)
class LocalityFigures:
    """What a plan costs to read, for one rank and one epoch (``wds-pad plan --summary``)."""

    shards: int              # shards read whole
    entries: int             # samples the rank yields (padded copies included)
    single: int              # entries read by a single ranged GET (foreign, 2+ windows early, or all with none)
    distinct_per_batch: float
    gets: int                # GETs per epoch: whole shards in blocks + single reads
    bytes_read: int
    bytes_used: int
    foreign: int = 0         # of ``single``: samples of other ranks' shards (the rebalance)

    @property
    def foreign_fraction(self) -> float:
        return self.single / self.entries if self.entries else 0.0


def figures(plan: Any, shard_of: Sequence[Any], lengths: Sequence[Any], shard_bytes: Sequence[Any],
            block_bytes: int) -> LocalityFigures:
    """The reading cost of ``plan`` (either locality) given per dataset the shard and the
    byte length of every sample and the bytes of every shard. O(the rank's share)."""
    samples = plan.samples
    sizes = np.diff(plan.offsets)
    b = np.repeat(plan.schedule[plan.batch_step], sizes)
    ds_of = np.asarray([plan.bucket_table[int(x)][0] for x in range(len(plan.bucket_table))], np.int64)
    ds_e = ds_of[b] if b.size else np.zeros(0, np.int64)
    shards = single = gets = read = used = 0
    distinct = 0
    batch_of = np.repeat(np.arange(len(plan), dtype=np.int64), sizes)
    local = plan.buckets.local
    for di in range(len(plan.datasets)):
        sel = np.flatnonzero(ds_e == di)
        sh = np.asarray(shard_of[di])[samples[sel]].astype(np.int64)
        ln = np.asarray(lengths[di])[samples[sel]].astype(np.int64)
        used += int(ln.sum())
        # distinct shards per batch
        key = np.unique(batch_of[sel] * (int(sh.max()) + 1 if sh.size else 1) + sh)
        distinct += key.size
        if local is None:
            single += sel.size
            gets += sel.size
            read += int(ln.sum())
            continue
        mine = local.rank_shards(di)
        own = np.isin(sh, mine)
        # an own shard's read two or more windows before its window is read singly (the
        # reader holds a shard from one window early, and keeps bytes for later reads)
        where = np.zeros(int(max(mine.max(initial=0), sh.max(initial=0))) + 1, np.int64)
        where[mine] = np.arange(mine.size) // plan.shard_window
        steps = np.repeat(plan.batch_step, sizes)[sel]
        own &= local.window_of_step(di, steps) - where[sh] >= -1
        sb = np.asarray(shard_bytes[di], dtype=np.int64)[mine]
        shards += int(mine.size)
        single += int((~own).sum())
        gets += int((-(-sb // block_bytes)).sum()) + int((~own).sum())
        read += int(sb.sum()) + int(ln[~own].sum())
    return LocalityFigures(shards=shards, entries=int(samples.size), single=single,
                           distinct_per_batch=distinct / max(len(plan), 1), gets=gets,
                           bytes_read=read, bytes_used=used,
                           foreign=local.foreign() if local is not None else 0)
