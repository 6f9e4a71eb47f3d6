"""The shard-level split: each epoch's shards dealt to the DP ranks, and each worker's plan.

What ``split_by_node``, ``equalize`` and ``ShardStream`` stream (stream/shards.py,
stream/shardstream.py), as pure functions of (seed, epoch, layout): the stream side
only puts the shard URLs in their canonical order (io/urls.py) and reads the shards.

Invariants:
- :func:`deal_shards`: the n shards, in their canonical order, are shuffled by an RNG
  derived from (seed, epoch, "shards") and extended cyclically by their own prefix to a
  multiple of dp_size; dp_rank d takes the padded positions p with p mod dp_size == d,
  so every rank holds the same number of shards, none twice, and a position p >= n is a
  padded copy. CP peers (same dp_rank) get the same shards;
- :func:`worker_plan`: DataLoader worker w of a rank takes that rank's shards
  ``[w::num_workers]`` (as webdataset's ``split_by_worker``) and yields ``target``
  samples, the most that worker w holds on any DP rank, wrapping over its own shards
  (over every shard if it has none);
- pure: no I/O, no clock; the same inputs give the same deal in every process.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from ...errors import ConfigError
from ..policy import rank_position
from ..seed import derive_rng
from ..topology import Topology

__all__ = ["WorkerPlan", "deal_shards", "worker_plan"]


def deal_shards(n: int, seed: int, epoch: int, dp_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Every DP rank's shards for ``epoch``: ``(shard, padded)``, both of shape
    ``(dp_size, ceil(n / dp_size))``; row d is dp_rank d's shards in order, as positions in
    the canonical shard order (int64), and whether each is a padded copy (bool)."""
    length = -(-n // dp_size) * dp_size
    if n == 0:
        return np.zeros((dp_size, 0), np.int64), np.zeros((dp_size, 0), bool)
    order = derive_rng(seed, epoch, "shards").permutation(n).astype(np.int64)
    p = rank_position(np.arange(dp_size, dtype=np.int64)[:, None], np.arange(length // dp_size, dtype=np.int64), dp_size)
    return order[p % n], p >= n


@dataclass(frozen=True)
class WorkerPlan:
    """What one DataLoader worker of one rank streams in one epoch.

    Attributes:
        shards: its (url, is_padded_copy) in order, read once each.
        cycle: URLs wrapped over, from the front, once ``shards`` are read.
        target: samples it yields in all.
    """

    shards: tuple[tuple[str, bool], ...]
    cycle: tuple[str, ...]
    target: int

    def __post_init__(self) -> None:
        if self.target < 0:
            raise ConfigError(f"WorkerPlan.target must be >= 0, got {self.target}")

    def shard_at(self, position: int) -> tuple[str, bool]:
        """The shard read at ``position``: the worker's own, then the cycle (padding)."""
        if position < len(self.shards):
            return self.shards[position]
        if not self.cycle:
            raise ConfigError("this worker has nothing to wrap over: the index has no shards")
        return self.cycle[(position - len(self.shards)) % len(self.cycle)], True


def worker_plan(counts: Mapping[str, int], seed: int, epoch: int, topology: Topology,
                worker: int, num_workers: int, order: Sequence[str] | None = None) -> WorkerPlan:
    """The :class:`WorkerPlan` of ``worker`` on this rank.

    Args:
        counts: url -> samples, in index order (a worker without shards wraps over them
            in this order).
        seed, epoch: the shared seed and the epoch whose deal to use.
        topology: this rank's Topology (its dp_size and dp_rank).
        worker, num_workers: this DataLoader worker and how many the rank has.
        order: the URLs of ``counts`` in their canonical order, the order every rank deals
            (stream/shards.py ``dealing_order``); default: sorted, which it is for URLs
            already canonical, as an index stores them.
    """
    urls = sorted(counts) if order is None else list(order)
    shard, padded = deal_shards(len(urls), seed, epoch, int(topology.dp_size))  # type: ignore[arg-type]
    assignment = [[(urls[s], p) for s, p in zip(row, pad)] for row, pad in zip(shard.tolist(), padded.tolist())]
    per_rank = [sum(counts[u] for u, _ in shards[worker::num_workers]) for shards in assignment]
    mine = tuple(assignment[int(topology.dp_rank)][worker::num_workers])  # type: ignore[arg-type]
    cycle = tuple(u for u, _ in mine) or tuple(counts)  # a worker without shards borrows from all
    return WorkerPlan(shards=mine, cycle=cycle, target=max(per_rank, default=0))
