"""Shard locality's per-bucket tables: how a bucket's global order is drawn from the deal.

Steps 2-4 of core/local/locality.py: a kept bucket's samples per shard (sparse, in visit
order), per window and per rank, the pools each window holds, the own entries each rank
keeps, the surplus it gives away and the foreign entries it receives; ``LocalBuckets``
is what a shard-local ``Plan`` computes its entries from (``Plan.buckets.local``).

Invariants:
- a bucket's global order is a permutation of its entries (each sample 1 + repeats
  times): rank d's entry k (k < its need) is its own window pools' entry, first in first
  out, or a foreign entry spread evenly through them; surpluses and deficits are matched
  in rank order, so the foreign count is ``sum(max(0, need_d - own_d))``, the fewest
  that make every share equal;
- global position p holds rank ``p mod dp_size``'s entry ``p // dp_size`` of the
  bucket's unpadded length, wrapping to the front for padded copies (p >= m);
- every key comes from :func:`~wds_pad.core.seed.derive_seed` and every step is integer
  numpy arithmetic: the same inputs give the same entries on every machine;
- a bucket costs O(the shards holding its samples) memory, a batch O(batch size x
  log(shards)).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from ...errors import ConfigError
from ..dataset import Dataset, IdRange
from .locality import DealtDataset, Locality, layouts, tail_needed
from ..permute import keyed_round_keys, permute
from ..policy import position_rank, rank_position, rank_share
from ..seed import derive_seed

if TYPE_CHECKING:
    from ..planning.buckettable import Kept, Planning

__all__ = ["LocalBuckets"]

_SCAN_FACTOR = 4  # a bucket of up to 4 x shards rows finds its shards by one scan of its rows


def _floor_mul_div(k: np.ndarray, f: np.ndarray, r: np.ndarray) -> np.ndarray:
    """``k * f // r`` exactly (int64 when it cannot overflow, Python ints otherwise)."""
    if k.size and int(k.max()) * int(f.max()) >= 2**62:
        return np.asarray([a * b // c for a, b, c in zip(k.tolist(), f.tolist(), r.tolist())], dtype=np.int64)
    return k * f // np.maximum(r, 1)


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

    def __init__(self, dealt: DealtDataset, ids: Any, passes: int, m: int, length: int,
                 dp: int, base_key: int, node_ranks: int = 1) -> None:
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
        self._nz = (nz_shard, nz_start, nz_count)  # until place(): the deal's windows may wait for the tails
        owner = np.searchsorted(dealt.rank_start, dealt.deal_pos[nz_shard], side="right") - 1
        own = np.bincount(owner, weights=nz_count, minlength=dealt.rank_start.size - 1).astype(np.int64) * passes
        real = min(m, length)
        # an owner (a rank, or a node of ``node_ranks`` consecutive DP ranks) needs its ranks' shares
        self.need = rank_share(real, dp, np.arange(dp, dtype=np.int64)).reshape(-1, node_ranks).sum(axis=1)
        self.own = own
        self.keep = np.minimum(own, self.need)            # own entries a rank yields itself
        self.surplus_cum = np.zeros(self.need.size + 1, np.int64)
        np.cumsum(np.maximum(own - self.need, 0), out=self.surplus_cum[1:])
        self.deficit = np.maximum(self.need - own, 0)
        self.deficit_cum = np.zeros(self.deficit.size + 1, np.int64)
        np.cumsum(self.deficit, out=self.deficit_cum[1:])
        self.passes, self.m, self.base_key, self.dealt, self.dp = passes, m, base_key, dealt, dp
        self.node_ranks = node_ranks
        self.local_pad = False  # locality="node": a node pads a bucket with its own entries

    def tail_needed(self) -> np.ndarray:
        """Per node, the fewest last shards of its deal that hold its surplus of b."""
        nz_shard, _, nz_count = self._nz
        return tail_needed(self.dealt, nz_shard, nz_count, self.surplus_cum[1:] - self.surplus_cum[:-1],
                           self.passes)

    def place(self) -> None:
        """The per-shard and per-window tables in this epoch's visit order (once the deal
        has its windows)."""
        dealt, s = self.dealt, int(self.dealt.layout.shard_bytes.size)
        nz_shard, nz_start, nz_count = self._nz
        del self._nz
        vis = dealt.visit_pos[nz_shard]
        o = np.argsort(vis, kind="stable")
        self.v_pos = _narrow(vis[o], s)                    # visit positions holding samples of b
        self.v_row = _narrow(nz_start[o], self.sorted_ids.size)  # their first row in sorted_ids
        self.v_cum = np.zeros(o.size + 1, np.int64)        # samples before each of them
        np.cumsum(nz_count[o], out=self.v_cum[1:])
        self.v_cum = _narrow(self.v_cum, self.sorted_ids.size)
        self.win_cum = self._cum_at(dealt.win_start)       # samples before each global window

    def _cum_at(self, vpos: np.ndarray) -> np.ndarray:
        """Samples of b at visit positions before each of ``vpos`` (int64)."""
        return self.v_cum[np.searchsorted(self.v_pos, vpos, side="left")].astype(np.int64)

    @property
    def win_samples(self) -> np.ndarray:
        """Samples of b in each global window's shards."""
        return np.diff(self.win_cum)

    def _pool_entries(self, g: np.ndarray, u: np.ndarray) -> np.ndarray:
        """Sample ids of pool entries u of global windows g: pass-major, shuffled per pass."""
        first = self.win_cum[g]
        n_w = self.win_cum[g + 1] - first
        pass_idx = u // n_w
        return self._ids_at(first + permute(u % n_w, n_w, keyed_round_keys(self.base_key, g * self.passes + pass_idx)))

    def _ids_at(self, vpos: np.ndarray) -> np.ndarray:
        """Sample ids at places ``vpos`` among b's samples in visit order."""
        i = np.searchsorted(self.v_cum, vpos, side="right") - 1
        rows = self.v_row[i].astype(np.int64) + (vpos - self.v_cum[i].astype(np.int64))
        return np.asarray(self.sorted_ids[rows], dtype=np.int64)

    def own_entries(self, d: np.ndarray, j: np.ndarray) -> np.ndarray:
        """Sample ids of rank d's own entries j (j >= keep[d]: its surplus, given away):
        its windows' pools one after another, in visit order (first in, first out)."""
        supply = self.win_cum.astype(np.int64) * self.passes   # pool entries before each window
        pos = supply[self.dealt.win_base[d]] + j
        g = np.searchsorted(supply, pos, side="right") - 1
        u = pos - supply[g]
        if not self.local_pad:
            return self._pool_entries(g, u)
        # a node's tail windows (its export shards): what it keeps in an order of the epoch,
        # what it gives away the same samples in the same order every epoch
        dd = d if np.ndim(d) else np.full(u.size, d)
        last = g >= self.dealt.tail_base[dd]
        out = np.empty(u.size, np.int64)
        if (~last).any():
            out[~last] = self._pool_entries(g[~last], u[~last])
        if last.any():
            gl, dl = g[last], dd[last]
            kept = np.clip(self.keep[dl] + supply[self.dealt.win_base[dl]] - supply[gl], 0, supply[gl + 1] - supply[gl])
            out[last] = self._export_entries(gl, u[last], kept)
        return out

    def _export_entries(self, g: np.ndarray, u: np.ndarray, kept: np.ndarray) -> np.ndarray:
        """Sample ids of pool entries u of a node's tail window g, whose first ``kept``
        entries the node keeps. The window's entries in visit order (pass-major): the node
        keeps the first ``kept``, shuffled by an epoch's permutation, and gives away the rest
        from the last backwards, the same samples every epoch, so a receiver's entries come
        from the last few shards of the window (the fewest that hold them)."""
        first = self.win_cum[g]
        n_w = self.win_cum[g + 1] - first
        inner = u < kept
        s = n_w * self.passes - 1 - (u - kept)
        if inner.any():
            s[inner] = permute(u[inner], kept[inner], keyed_round_keys(self.base_key ^ 0xE59, g[inner]))
        return self._ids_at(first + s % n_w)

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
        """Sample ids at global positions ``pos``: rank ``p mod dp``'s entry ``p // dp``,
        which is its owner's entry ``j + k * node_ranks`` (the ranks of a node take its entries
        in turn; ``j`` the rank's place on its node). A padded position (``p >= m``) copies
        the front of the bucket's global order (shard locality) or, with nodes, the front
        of its node's own entries, so that a node's copies are of its own shards (a node
        with no entry of the bucket copies the global front)."""
        if self.local_pad:
            o, x = self._owner_entry(pos, dp)
            need = self.need[o]
            over = (x >= need) & (need > 0)
            x = np.where(over, (x - need) % np.maximum(need, 1), x)
            out = np.empty(pos.size, np.int64)
            inside = (pos < self.m) | over
            if inside.any():
                out[inside] = self.rank_entries(o[inside], x[inside])
            if (~inside).any():
                out[~inside] = self.entries_global(pos[~inside], dp)
            return out
        return self.entries_global(pos, dp)

    def entries_global(self, pos: np.ndarray, dp: int) -> np.ndarray:
        """Sample ids at global positions ``pos``, padded ones wrapping to the global front."""
        return self.rank_entries(*self._owner_entry(pos % self.m, dp))

    def _owner_entry(self, pos: np.ndarray, dp: int) -> tuple[np.ndarray, np.ndarray]:
        """(owner, its entry) of global positions ``pos``: the entry of rank ``p mod dp`` a
        node's ranks take in turn."""
        d, k = position_rank(pos, dp)
        return d // self.node_ranks, d % self.node_ranks + k * self.node_ranks


class LocalBuckets:
    """The kept buckets of a shard-local plan: what ``Plan`` computes entries from.

    With ``locality="node"`` the shards are dealt to nodes of ``node_ranks`` g
    consecutive DP ranks for good, the tables below are a node's, and a node's ranks take
    its entries in turn: everything said of "a rank" is said of its node."""

    def __init__(self, raw: Sequence[Any], dss: Sequence[Dataset], kept: Sequence[Kept], at: Planning) -> None:
        seed, epoch, dp = at.seed, at.epoch, at.dp
        stable = at.locality is Locality.NODE  # dealt to nodes, the same every epoch
        node_ranks = at.node_ranks if stable else 1
        self.dealt = [DealtDataset(lay, ds.name, seed, epoch, dp // node_ranks, at.window, stable=stable)
                      for lay, ds in zip(layouts(raw, dss), dss)]
        self.buckets = [
            _LocalBucket(self.dealt[k.di], k.ids, k.passes, k.n * k.passes, k.length, dp,
                         derive_seed(seed, epoch, dss[k.di].name, k.key, "window"), node_ranks)
            for k in kept]
        self.kept_dataset = [k.di for k in kept]
        for di, dealt in enumerate(self.dealt):
            if stable:  # a node's tail holds what it gives away of every bucket
                need = [bk.tail_needed() for bk, kd in zip(self.buckets, self.kept_dataset) if kd == di]
                dealt.set_tails(np.max(need, axis=0) if need else np.zeros(dealt.rank_start.size - 1, np.int64))
        for bk in self.buckets:
            bk.local_pad = stable
            bk.place()
        self.dp, self.d, self.window, self.node_ranks = dp, at.d, at.window, node_ranks
        self.set_steps(0)  # the planner gives the epoch's steps once its schedule is drawn

    def set_steps(self, total: int) -> None:
        """Give each window its span of the epoch's ``total`` global steps: its share of its
        rank's samples (every bucket), in steps (what the reader holds its shards for)."""
        self.win_step: list[np.ndarray] = []
        for di, dealt in enumerate(self.dealt):
            mine = [bk for bk, kd in zip(self.buckets, self.kept_dataset) if kd == di]
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
        return self.at(b, rank_position(self.d, np.asarray(k, np.int64), self.dp))

    def at(self, b: np.ndarray, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(sample ids, padded flags) at global positions ``pos`` of kept buckets ``b``."""
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
        """Shard numbers of dataset ``di`` dealt to rank d (default: this rank; with nodes,
        its node), in visit order."""
        dealt = self.dealt[di]
        o = (self.d if d is None else d) // self.node_ranks
        return dealt.visit[dealt.rank_start[o]:dealt.rank_start[o + 1]]

    def foreign(self, d: int | None = None) -> int:
        """Foreign entries of rank d (default: this rank) over every kept bucket: with
        nodes, those of its node's foreign entries that fall to it."""
        d = self.d if d is None else d
        o, j = d // self.node_ranks, d % self.node_ranks
        if self.node_ranks == 1:
            return int(sum(int(bk.deficit[o]) for bk in self.buckets))
        total = 0
        for bk in self.buckets:
            k = np.arange(j, int(bk.need[o]), self.node_ranks, dtype=np.int64)
            r, f = np.full(k.size, bk.need[o]), np.full(k.size, bk.deficit[o])
            total += int(np.count_nonzero(_floor_mul_div(k + 1, f, r) > _floor_mul_div(k, f, r)))
        return total

    def window_of_step(self, di: int, steps: np.ndarray, d: int | None = None) -> np.ndarray:
        """Rank d's window (0, 1, ... in its (node's) visit order) whose step span holds each step."""
        d = (self.d if d is None else d) // self.node_ranks
        dealt = self.dealt[di]
        lo, hi = int(dealt.win_base[d]), int(dealt.win_base[d + 1])
        if hi == lo:
            return np.full(np.asarray(steps).shape, -1, np.int64)
        return np.searchsorted(self.win_step[di][lo:hi], steps, side="right") - 1
