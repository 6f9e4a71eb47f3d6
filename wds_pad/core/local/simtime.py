"""The time model of ``wds-pad simulate``: when a job's reads arrive, as its readers make them.

A job is nodes of processes; each process reads its entries (its plan's samples, in batch
order, epoch after epoch) through one reader, and the model follows that reader
(io/ranges.py, io/inflight.py, io/nodecache.py):

- **start**: nothing is sent to the store before ``start_s`` after the stream starts
  (``iter()``: the node's plans made, the filesystem and its connections opened, the
  modules imported); a fixed cost of the machine, measured, not derived. The job's
  processes do not start at once: process i of P (node by node) starts ``start_skew_s``
  x i / (P - 1) after the first (:func:`start_offsets`), its fetches and reads from then
  on; which process starts last is chance in a real job, the model takes the job's order;
- **whole shards**: a node holds some shards (:class:`Held`); each process fetches the held
  shards it reads, in the order it first reads them (a step's in shard order), ``shards_at_once`` at a time, and
  skips one another process of the node started or the folder kept; a shard comes in GETs
  of ``block_bytes``, ``gets_per_shard`` in flight, each sent when the one
  ``gets_per_shard`` before it arrived. An epoch's fetches start when the node sends its
  first read of the epoch (the first epoch's at ``start_s``). A read of a held shard is
  served in order by one thread, once the block holding its end has arrived, or the same
  block of a fetch of the shard the read starts itself when the thread reaches it, if no
  process started it before;
- **reads in flight**: a process keeps ``in_flight`` reads sent ahead of the one it hands
  out, in order: a read is sent when the read ``in_flight`` before it is handed out, and
  only while the stream runs. With ``ahead`` 0 the stream runs inside ``next()``: from
  when a step asks for its batch until the batch is made; with ``ahead`` N it makes
  batches while fewer than N wait. A batch is made once its last read is there (the
  stream knows each batch's size: it does not wait for the next batch's first read).
  A single read (of a shard the node does not hold) is one GET;
- **a GET** takes ``latency_s`` plus its bytes at ``bandwidth`` (GETs in flight do not share it);
- **steps**: every process is asked for step s's batch at once, the job takes it when
  every process has it (the step's collectives), and asks for the next ``step_s`` later.
  Step 0 is asked of each process when its stream starts; ``first_s`` is the longest a
  process waits for its first batch from its own start (``start_s`` included); a later step
  stalls when it is taken more than ``stall_s`` after it was asked for.

Invariants:
- pure (no I/O, no clock), deterministic; O(reads + held shards x log) per job, one
  Python pass over every read;
- a read is never served before it is sent, nor a batch handed out before it is asked
  for, nor step s+1 asked for before step s is taken plus ``step_s``.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ...errors import ConfigError

__all__ = ["Held", "Link", "ProcessReads", "Timeline", "start_offsets", "timeline"]


@dataclass(frozen=True)
class Link:
    """A node's connection to the store, its readers, and the training step's time."""

    latency_s: float = 0.020
    bandwidth: float = 125e6          # bytes per second (1000 Mbit/s)
    step_s: float = 0.100
    in_flight: int = 8                # reads a process keeps sent ahead (ReadOptions.max_in_flight)
    lookahead: int = 0                # batches made ahead of the step that asks for them (0: inside next())
    start_s: float = 0.0              # the stream's start before its first request
    start_skew_s: float = 0.0         # the processes' starts spread over this much (see start_offsets)
    stall_s: float = 0.0              # a step stalls when it waits longer than this
    shards_at_once: int = 2           # whole shards a process fetches at once (the node cache's depth)
    gets_per_shard: int = 2           # GETs in flight per shard fetched


@dataclass(frozen=True)
class Held:
    """The shards a node holds, every epoch's after the other (one row per (epoch, shard))."""

    blocks: np.ndarray     # GETs to fetch it; 0: the folder kept it (no fetch)
    nbytes: np.ndarray     # its bytes
    epoch: np.ndarray      # the epoch (0, 1, ... of the simulation) it is held in


@dataclass(frozen=True)
class ProcessReads:
    """One process's reads, every epoch's after the other, in the order it makes them."""

    batch_ends: np.ndarray     # per step: one past its batch's last read
    held: np.ndarray           # per read: the row of ``Held`` serving it, or -1: one GET
    block: np.ndarray          # per read of a held shard: the block holding its end
    nbytes: np.ndarray         # per read: its bytes
    epoch_starts: np.ndarray   # per epoch: its first read
    order: Sequence[np.ndarray]  # per epoch: the held rows it reads, in order of first read


@dataclass(frozen=True)
class Timeline:
    """When each step was asked for and taken, and what that makes of the first batch and stalls."""

    asked: np.ndarray
    taken: np.ndarray
    first_s: float
    stalls: int
    stall_share: float


class _Node:
    """A node's held shards and when their fetches start, planned per epoch when first needed."""

    def __init__(self, held: Held, procs: Sequence[ProcessReads], link: Link, block_bytes: int,
                 starts: Sequence[float]) -> None:
        self.held, self.procs, self.link, self.starts = held, procs, link, starts
        self.block_s = link.latency_s + np.minimum(held.nbytes, block_bytes) / link.bandwidth  # one GET of a block
        self.started = np.full(held.blocks.size, np.inf)
        self.planned: set[int] = set()
        self.epoch_sent: dict[int, float] = {0: min(starts, default=link.start_s)}

    def sent(self, epoch: int, t: float) -> None:
        self.epoch_sent[epoch] = min(self.epoch_sent.get(epoch, t), t)

    def arrival(self, row: int, block: int, epoch: int, sent: float) -> float:
        """When block ``block`` of held row ``row`` is in the node's copy, for a read sent at ``sent``."""
        if self.held.blocks[row] == 0:
            return 0.0
        if epoch not in self.planned:
            self._plan(epoch)
        if sent < self.started[row]:  # no process started it yet: this read fetches it, whole
            self.started[row] = sent
        per = max(self.link.gets_per_shard, 1)
        return float(self.started[row]) + (block // per + 1) * float(self.block_s[row])

    def _plan(self, epoch: int) -> None:
        """Each process fetches its order's shards ``shards_at_once`` at a time (see the module doc)."""
        self.planned.add(epoch)
        t0 = self.epoch_sent.get(epoch, self.link.start_s)
        orders = [p.order[epoch] if epoch < len(p.order) else np.zeros(0, np.int64) for p in self.procs]
        per = max(self.link.gets_per_shard, 1)
        heap = [(max(t0, self.starts[k]), k, slot) for k in range(len(orders))
                for slot in range(max(self.link.shards_at_once, 1))]
        heapq.heapify(heap)
        at = [0] * len(orders)
        while heap:
            t, k, slot = heapq.heappop(heap)
            order = orders[k]
            while at[k] < order.size and (self.started[order[at[k]]] < np.inf or self.held.blocks[order[at[k]]] == 0):
                at[k] += 1
            if at[k] == order.size:
                continue
            row = int(order[at[k]])
            at[k] += 1
            self.started[row] = t
            rounds = -(-int(self.held.blocks[row]) // per)
            heapq.heappush(heap, (t + rounds * float(self.block_s[row]), k, slot))


def start_offsets(processes: int, skew_s: float) -> np.ndarray:
    """When each of the job's processes starts its stream, after the first: ``skew_s`` spread
    evenly over them in the job's order (node by node, local rank by local rank)."""
    if processes < 2 or skew_s <= 0:
        return np.zeros(max(processes, 0))
    return skew_s * np.arange(processes) / (processes - 1)


def timeline(nodes: Sequence[tuple[Held, Sequence[ProcessReads]]], steps: int, link: Link,
             block_bytes: int, offsets: Sequence[float] | None = None) -> Timeline:
    """When a job's steps are taken (see the module doc).

    Args:
        nodes: per node, its held shards and its processes' reads (each process has
            ``steps`` batches).
        steps: the job's steps, every epoch's after the other.
        link: the time model's parameters.
        block_bytes: the bytes of one GET of a shard fetched whole.
        offsets: per process of the job (node by node), when its stream starts after the
            first one's (default: :func:`start_offsets` of ``link.start_skew_s``).
    """
    asked, taken = np.zeros(steps), np.zeros(steps)
    if steps == 0:
        return Timeline(asked, taken, 0.0, 0, 0.0)
    count = sum(len(procs) for _, procs in nodes)
    offs = np.asarray(start_offsets(count, link.start_skew_s) if offsets is None else offsets, float)
    if offs.shape != (count,) or not np.all(offs >= 0):
        raise ConfigError(f"timeline offsets: give one start >= 0 per process of the job ({count} processes, "
                          f"node by node), got {offs.tolist()}")
    state, at = [], 0
    for held, procs in nodes:  # one node, its copies and fetches, shared by its processes
        starts = [link.start_s + float(o) for o in offs[at:at + len(procs)]]
        node = _Node(held, procs, link, block_bytes, starts)
        state += [_Process(node, p, link, steps, start) for p, start in zip(procs, starts)]
        at += len(procs)
    for s in range(steps):
        asked[s] = 0.0 if s == 0 else taken[s - 1] + link.step_s
        taken[s] = max([asked[s]] + [st.step(s, asked) for st in state])
    waits = taken[1:] - asked[1:]
    stalls = int((waits > link.stall_s + 1e-12).sum())
    # the first batch: the longest a process waits for it from its own stream's start
    first = max(float(st.made[0]) - (st.start - link.start_s) for st in state) if state else float(taken[0])
    return Timeline(asked, taken, max(first, 0.0), stalls, stalls / max(steps - 1, 1))


class _Process:
    """One process's stream: sends, hands out and makes batches (see the module doc)."""

    def __init__(self, node: _Node, reads: ProcessReads, link: Link, steps: int, start: float) -> None:
        self.node, self.r, self.link, self.start = node, reads, link, start
        n = int(reads.held.size)
        self.popped = np.zeros(n)          # when each read was handed out
        self.served = start                # when the copy's read thread served its latest read
        self.made = np.zeros(steps)        # when each batch was made
        self.ready = np.zeros(steps)       # when the step had it
        self.last = start                  # when the latest read was handed out
        self.epoch_of = np.searchsorted(reads.epoch_starts, np.arange(n), side="right") - 1

    def _runs_from(self, s: int, asked: np.ndarray) -> float:
        """When the stream starts making batch s."""
        n = self.link.lookahead
        if n <= 0:
            return float(asked[s])
        before = float(self.made[s - 1]) if s else self.start
        freed = float(self.ready[s - n]) if s - n >= 0 else self.start
        return max(before, freed)

    def step(self, s: int, asked: np.ndarray) -> float:
        r, link = self.r, self.link
        run = max(self._runs_from(s, asked), self.start)
        lo = int(r.batch_ends[s - 1]) if s else 0
        hi = int(r.batch_ends[s])
        t = run
        for j in range(lo, hi):  # a batch leaves with its last read (the stream knows each batch's size)
            t = max(t, self._got(j))
            self.popped[j] = t
        self.made[s] = t
        self.ready[s] = max(t, float(asked[s]))
        return float(self.ready[s])

    def _got(self, j: int) -> float:
        """When read j's bytes are there."""
        r, link = self.r, self.link
        w = max(link.in_flight, 1)
        sent = max(float(self.popped[j - w]), self.start) if j >= w else self.start
        e = int(self.epoch_of[j])
        if j == r.epoch_starts[e]:
            self.node.sent(e, sent)
        row = int(r.held[j])
        if row < 0:
            got = sent + link.latency_s + float(r.nbytes[j]) / link.bandwidth
        else:  # one thread serves the node's copy, in order: it reaches this read after the one before
            reach = max(sent, self.served)
            got = self.served = max(reach, self.node.arrival(row, int(r.block[j]), e, reach))
        return got
