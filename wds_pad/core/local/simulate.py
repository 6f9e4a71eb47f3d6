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

Time is :mod:`~.simtime`'s model of the readers: each process fetches ahead, from its
stream's start (the processes' starts spread over ``link.start_skew_s``), the held shards
it reads in order of first use (a few at a time, a few GETs each), keeps a few reads in
flight ahead of the one it hands out, and the job takes a step once every process has its
batch and asks for the next ``step_s`` later.

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
from .simtime import Held, Link, ProcessReads, timeline

__all__ = ["Link", "NodeEpochCost", "Prices", "Simulation", "simulate"]


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
    extra: dict[str, Any] = field(default_factory=dict)  # "asked", "taken": each step's times (s from the start)

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
             link: Link = Link(), prices: Prices = Prices(), warm: bool = False,
             offsets: Sequence[Any] | None = None) -> Simulation:
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
        offsets: per dataset, each sample id's byte offset in its shard: a read of a
            shard being fetched waits for the block holding its end (None: for the
            whole shard).
    """
    nodes = len(plans[0]) if plans else 0
    kept: list[list[np.ndarray] | None] = [None] * nodes
    per_node: list[list[NodeEpochCost]] = [[] for _ in range(nodes)]
    timing: list[list[tuple[Held, list[_EpochReads]]]] = [[] for _ in range(nodes)]
    steps = []
    for epoch_plans in plans:
        length = max((len(p) for node in epoch_plans for p in node), default=0)
        steps.append(length)
        for n, node in enumerate(epoch_plans):
            cost, held, reads, rows = _node_epoch(node, shard_of, lengths, shard_bytes, block_bytes, kept[n], length,
                                                  warm and not timing[n], offsets)
            kept[n] = held
            per_node[n].append(cost)
            timing[n].append((rows, reads))
    tl = timeline([_joined(t) for t in timing], sum(steps), link, block_bytes)
    gets = sum(c.gets for n in per_node for c in n)
    nbytes = sum(c.bytes_read for n in per_node for c in n)
    return Simulation(epochs=list(epochs) if epochs is not None else list(range(len(plans))), steps=steps,
                      nodes=per_node, first_batch_s=tl.first_s, stall_share=tl.stall_share, stalls=tl.stalls,
                      cost_usd=gets * prices.per_get + nbytes / 1e9 * prices.per_gb,
                      extra={"asked": tl.asked, "taken": tl.taken})


@dataclass(frozen=True)
class _EpochReads:
    """One process's reads in one epoch (see :class:`~.simtime.ProcessReads`), rows of the epoch's ``Held``."""

    batch_ends: np.ndarray
    held: np.ndarray
    block: np.ndarray
    nbytes: np.ndarray
    order: np.ndarray


def _joined(epochs: list[tuple[Held, list[_EpochReads]]]) -> tuple[Held, list[ProcessReads]]:
    """A node's epochs one after the other: its held rows and each process's reads."""
    held = Held(blocks=np.concatenate([h.blocks for h, _ in epochs]), nbytes=np.concatenate([h.nbytes for h, _ in epochs]),
                epoch=np.concatenate([np.full(h.blocks.size, e, np.int64) for e, (h, _) in enumerate(epochs)]))
    procs = []
    for k in range(max(len(r) for _, r in epochs)):
        rows = reads = 0
        ends, rowl, blocks, nbytes, starts, order = [], [], [], [], [], []
        for h, per in epochs:
            r = per[min(k, len(per) - 1)]
            starts.append(reads)
            ends.append(r.batch_ends + reads)
            rowl.append(np.where(r.held >= 0, r.held + rows, -1))
            blocks.append(r.block)
            nbytes.append(r.nbytes)
            order.append(r.order + rows)
            rows += h.blocks.size
            reads += r.held.size
        procs.append(ProcessReads(batch_ends=np.concatenate(ends), held=np.concatenate(rowl),
                                  block=np.concatenate(blocks), nbytes=np.concatenate(nbytes),
                                  epoch_starts=np.asarray(starts, np.int64), order=order))
    return held, procs


def _node_epoch(node: Sequence[Any], shard_of: Sequence[Any], lengths: Sequence[Any], shard_bytes: Sequence[Any],
                block_bytes: int, kept: list[np.ndarray] | None, length: int, warm: bool,
                offsets: Sequence[Any] | None) -> tuple[NodeEpochCost, list[np.ndarray], list[_EpochReads], Held]:
    reads, imports = node_reads(node, shard_of, lengths)
    plan_of = list({id(p): p for p in node}.values())
    gets = nbytes = fetched = held_n = single = held_bytes = 0
    held_all = []
    per_plan = [(np.full(int(p.offsets[-1]), -1, np.int64), np.zeros(int(p.offsets[-1]), np.int64),
                 np.zeros(int(p.offsets[-1]), np.int64)) for p in plan_of]  # held row, end block, bytes per read
    row_blocks, row_bytes = [], []
    base = 0
    for di in range(len(shard_of)):
        held = node_held([r for r, _ in reads], di, imports)
        held_all.append(held)
        sb = np.asarray(shard_bytes[di], np.int64)
        before = held if warm else (kept[di] if kept is not None else np.zeros(0, np.int64))
        new = np.setdiff1d(held, before)
        blocks = -(-sb[held] // block_bytes)
        row_blocks.append(np.where(np.isin(held, new), blocks, 0))
        row_bytes.append(sb[held])
        for ((r, count), plan), (row, block, size) in zip(zip(reads, plan_of), per_plan):
            rd = r[di]
            inside = np.isin(rd.shard, held)
            out = ~inside
            n_out, b_out = count * int(out.sum()), count * int(rd.length[out].sum())
            single += n_out
            gets += n_out
            nbytes += b_out
            at = np.minimum(np.searchsorted(held, rd.shard), max(held.size - 1, 0))
            row[rd.entries[inside]] = base + at[inside]
            size[rd.entries] = rd.length
            if offsets is not None:
                ends = np.asarray(offsets[di], np.int64)[plan.samples[rd.entries]] + rd.length
                block[rd.entries] = np.maximum(ends - 1, 0) // block_bytes
            elif held.size:
                block[rd.entries] = np.maximum(blocks[at] - 1, 0)
        gets += int(-(-sb[new] // block_bytes).sum()) if new.size else 0
        nbytes += int(sb[new].sum())
        fetched += int(new.size)
        held_n += int(held.size)
        held_bytes += int(sb[held].sum()) if held.size else 0
        base += int(held.size)
    rows = Held(blocks=np.concatenate(row_blocks + [np.zeros(0, np.int64)]),
                nbytes=np.concatenate(row_bytes + [np.zeros(0, np.int64)]), epoch=np.zeros(base, np.int64))
    out_reads = []
    for plan, (row, block, size) in zip(plan_of, per_plan):
        ends = np.asarray(plan.offsets[1:], np.int64)
        ends = np.concatenate([ends, np.full(max(length - ends.size, 0), ends[-1] if ends.size else 0, np.int64)])
        step = np.repeat(np.arange(len(plan), dtype=np.int64), np.diff(plan.offsets))
        first = np.full(base, length + 1, np.int64)
        np.minimum.at(first, row[row >= 0], step[row >= 0])
        mine = np.flatnonzero(first <= length)
        order = mine[np.argsort(first[mine], kind="stable")]  # by first step, then shard (its URL)
        out_reads.append(_EpochReads(batch_ends=ends, held=row, block=block, nbytes=size, order=order))
    return (NodeEpochCost(gets=gets, bytes_read=nbytes, fetched=fetched, held=held_n, single=single,
                          held_bytes=held_bytes), held_all, out_reads, rows)
