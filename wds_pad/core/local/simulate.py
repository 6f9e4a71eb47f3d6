"""Before the run: what a job's plans will cost to read, node by node and epoch by epoch.

The plans are the schedule of every read a job makes, so what its node caches fetch can
be counted before it starts (``wds-pad simulate``). A node here is the processes that
share one cache folder (``ReadOptions(cache_dir=...)``, or the folder a torchrun job
shares by default); each epoch it holds the shards of :func:`~.reads.node_held`
(the shards its processes read whole, and with ``locality="node"`` the other nodes'
shards it reads), fetched whole in blocks of ``block_bytes``, and it reads every other
sample by a single ranged GET (each process its own). A shard it held in the epoch
before is still in its folder (a shard is kept exactly when the node holds it again),
so it costs no GET again; ``warm`` starts on a folder left by an earlier run of the
same job (it holds what the first epoch holds).

Time is a model, not a measurement: each node downloads over its own link (``latency_s``
per round of ``in_flight`` GETs, ``bandwidth`` bytes per second), a shard's bytes are
due at the first step that reads it and a single read's at its step; a node starts on a
step's bytes ``lookahead`` steps before the step is asked for (0: when it is), one step's
after another; the job takes a step once every node has its bytes, and asks for the next
``step_s`` later. The first batch comes when step 0's bytes have arrived; a step stalls
when its bytes arrive after it is asked for.

Invariants:
- pure (no I/O, no clock): from the plans and, per dataset, each sample's shard and byte
  length and each shard's bytes; O(the job's entries) per epoch;
- a node's GETs of an epoch are the blocks of the shards it holds and did not hold the
  epoch before, plus its single reads of shards it does not hold: the figures of
  :func:`wds_pad.cli.readfigures.node_figures` less what the folder kept;
- the peak bytes of a node's folder is the largest bytes of the shards it holds in an
  epoch (what it needs to fetch nothing twice within an epoch).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from .reads import node_held, node_reads

__all__ = ["Link", "NodeEpochCost", "Prices", "Simulation", "simulate"]


@dataclass(frozen=True)
class Link:
    """A node's connection to the store, and the training step's time."""

    latency_s: float = 0.020
    bandwidth: float = 125e6          # bytes per second (1000 Mbit/s)
    step_s: float = 0.100
    in_flight: int = 8                # GETs a node has under way at once
    lookahead: int = 0                # steps ahead a node starts on a step's bytes (0: when asked)


@dataclass(frozen=True)
class Prices:
    """What the store charges: per GET, and per GB (10^9 bytes) read."""

    per_get: float = 0.0
    per_gb: float = 0.0


@dataclass(frozen=True)
class NodeEpochCost:
    """One node's reads in one epoch."""

    gets: int                 # GETs: blocks of the shards fetched + single reads
    bytes_read: int
    fetched: int              # shards fetched whole (held, and not kept from before)
    held: int                 # shards the node holds in the epoch
    single: int               # single ranged GETs (samples of shards it does not hold)
    held_bytes: int           # bytes of the shards it holds


@dataclass(frozen=True)
class Simulation:
    """What a job will read: per node and epoch, and the job's time and cost."""

    epochs: list[int]
    steps: list[int]                      # steps per epoch
    nodes: list[list[NodeEpochCost]]      # [node][epoch]
    first_batch_s: float
    stall_share: float
    cost_usd: float
    stalls: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def gets_per_epoch(self) -> list[int]:
        return [sum(n[e].gets for n in self.nodes) for e in range(len(self.epochs))]

    @property
    def bytes_per_epoch(self) -> list[int]:
        return [sum(n[e].bytes_read for n in self.nodes) for e in range(len(self.epochs))]

    @property
    def peak_cache_bytes(self) -> int:
        """The most bytes one node's folder holds (the largest node)."""
        return max((c.held_bytes for n in self.nodes for c in n), default=0)

    def to_json(self) -> dict[str, Any]:
        return {
            "epochs": self.epochs, "steps_per_epoch": self.steps,
            "gets_per_epoch": self.gets_per_epoch, "bytes_per_epoch": self.bytes_per_epoch,
            "first_batch_s": self.first_batch_s, "stall_share": self.stall_share, "stalls": self.stalls,
            "peak_cache_bytes": self.peak_cache_bytes, "cost_usd": self.cost_usd,
            "nodes": [{"node": i, "gets": [c.gets for c in n], "bytes": [c.bytes_read for c in n],
                       "shards_fetched": [c.fetched for c in n], "shards_held": [c.held for c in n],
                       "single_reads": [c.single for c in n],
                       "peak_cache_bytes": max((c.held_bytes for c in n), default=0)}
                      for i, n in enumerate(self.nodes)],
        }


def simulate(plans: Sequence[Sequence[Sequence[Any]]], shard_of: Sequence[Any], lengths: Sequence[Any],
             shard_bytes: Sequence[Any], block_bytes: int, *, epochs: Sequence[int] | None = None,
             link: Link = Link(), prices: Prices = Prices(), warm: bool = False) -> Simulation:
    """The reads of a job, from its plans.

    Args:
        plans: ``plans[e][n]``: epoch e's plans of node n's processes, one per process
            (context-parallel peers may pass one plan object: it is read once per peer).
        shard_of, lengths, shard_bytes: per dataset, each sample id's shard and byte
            length, and each shard's bytes.
        block_bytes: the bytes of one GET of a shard fetched whole.
        epochs: the epoch numbers (labels only; default 0, 1, ...).
        link, prices: the time and price model.
        warm: the nodes' folders hold what the first epoch holds (a restart of the job).
    """
    nodes = len(plans[0]) if plans else 0
    kept: list[list[np.ndarray] | None] = [None] * nodes
    per_node: list[list[NodeEpochCost]] = [[] for _ in range(nodes)]
    due: list[list[np.ndarray]] = [[] for _ in range(nodes)]  # per node, per epoch: (gets, bytes) per step
    steps = []
    for e, epoch_plans in enumerate(plans):
        length = max((len(p) for node in epoch_plans for p in node), default=0)
        steps.append(length)
        for n, node in enumerate(epoch_plans):
            cost, table, held = _node_epoch(node, shard_of, lengths, shard_bytes, block_bytes, kept[n], length,
                                            warm and e == 0)
            kept[n] = held
            per_node[n].append(cost)
            due[n].append(table)
    first, stall, stalls = _timeline(due, link)
    gets = sum(c.gets for n in per_node for c in n)
    nbytes = sum(c.bytes_read for n in per_node for c in n)
    return Simulation(epochs=list(epochs) if epochs is not None else list(range(len(plans))), steps=steps,
                      nodes=per_node, first_batch_s=first, stall_share=stall, stalls=stalls,
                      cost_usd=gets * prices.per_get + nbytes / 1e9 * prices.per_gb)


def _node_epoch(node: Sequence[Any], shard_of: Sequence[Any], lengths: Sequence[Any], shard_bytes: Sequence[Any],
                block_bytes: int, kept: list[np.ndarray] | None, length: int,
                warm: bool) -> tuple[NodeEpochCost, np.ndarray, list[np.ndarray]]:
    reads, imports = node_reads(node, shard_of, lengths)
    batch_of = {id(p): np.repeat(np.arange(len(p), dtype=np.int64), np.diff(p.offsets)) for p in node}
    plan_of = list({id(p): p for p in node}.values())
    table = np.zeros((2, max(length, 1)), np.int64)  # GETs, bytes due at each step
    gets = nbytes = fetched = held_n = single = held_bytes = 0
    held_all = []
    for di in range(len(shard_of)):
        held = node_held([r for r, _ in reads], di, imports)
        held_all.append(held)
        sb = np.asarray(shard_bytes[di], np.int64)
        before = held if warm else (kept[di] if kept is not None else np.zeros(0, np.int64))
        new = np.setdiff1d(held, before)
        first = np.full(new.size, max(length - 1, 0), np.int64)  # each fetched shard's first step
        for (r, count), plan in zip(reads, plan_of):
            rd = r[di]
            step = batch_of[id(plan)][rd.entries]
            if new.size:
                pos = np.minimum(np.searchsorted(new, rd.shard), new.size - 1)
                hit = new[pos] == rd.shard
                np.minimum.at(first, pos[hit], step[hit])
            out = rd.single & ~np.isin(rd.shard, held)
            n_out, b_out = count * int(out.sum()), count * int(rd.length[out].sum())
            single += n_out
            gets += n_out
            nbytes += b_out
            np.add.at(table[0], step[out], count)
            np.add.at(table[1], step[out], count * rd.length[out])
        blocks = -(-sb[new] // block_bytes) if new.size else np.zeros(0, np.int64)
        gets += int(blocks.sum())
        nbytes += int(sb[new].sum())
        np.add.at(table[0], first, blocks)
        np.add.at(table[1], first, sb[new])
        fetched += int(new.size)
        held_n += int(held.size)
        held_bytes += int(sb[held].sum()) if held.size else 0
    return (NodeEpochCost(gets=gets, bytes_read=nbytes, fetched=fetched, held=held_n, single=single,
                          held_bytes=held_bytes), table[:, :max(length, 0)], held_all)


def _timeline(due: list[list[np.ndarray]], link: Link) -> tuple[float, float, int]:
    """(first batch s, share of steps after the first that stall, stalls) of the job.

    Step s is asked for at ``q[s]`` (the previous batch's arrival plus a step); a node
    starts on step s's bytes once its link is free and step ``s - lookahead`` is asked
    for; the job takes the batch once every node has its bytes. A step after the first
    stalls when its bytes arrive after it is asked for.
    """
    if not due or not due[0]:
        return 0.0, 0.0, 0
    tables = [np.concatenate(node, axis=1) for node in due]
    n = tables[0].shape[1]
    if n == 0:
        return 0.0, 0.0, 0
    cost = [np.ceil(t[0] / max(link.in_flight, 1)) * link.latency_s + t[1] / link.bandwidth for t in tables]
    free = [0.0] * len(tables)
    asked = np.zeros(n)
    ahead = max(int(link.lookahead), 0)
    first = 0.0
    stalls = 0
    taken = 0.0
    for s in range(n):
        asked[s] = 0.0 if s == 0 else taken + link.step_s
        start = float(asked[max(s - ahead, 0)])
        ready = asked[s]
        for k, c in enumerate(cost):
            if c[s] > 0:
                free[k] = max(free[k], start) + float(c[s])
                ready = max(ready, free[k])
        if s == 0:
            first = float(ready)
        elif ready > asked[s] + 1e-12:
            stalls += 1
        taken = float(ready)
    return first, stalls / max(n - 1, 1), stalls
