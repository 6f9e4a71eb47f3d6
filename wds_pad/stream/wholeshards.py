"""What a stream reads whole, per epoch: its DataLoader worker's shards (``locality="shard"``)
or its node's record (the node cache), made from the plan.

Invariants:
- ``shard_schedule`` and ``node_schedule`` turn core's int64 schedules (core/local/shardschedule.py)
  into the reader's records (io/shardplan.py), O(the rank's or node's share) per epoch;
  ``whole_shards`` sets the reader on one of them: the node's copies when the node's
  processes share a folder, else this process's memory;
- nothing is asked of the other processes: another rank's plan is recomputed here (pure);
- no I/O here beyond naming and joining the node's folder.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Mapping
from dataclasses import replace
from typing import Any, Callable, Iterator

import numpy as np

from ..core.local.locality import Locality
from ..core.local.shardschedule import NodeUses, node_uses, shard_reads
from ..core.planning.plan import Plan
from ..core.policy import Mode
from ..core.topology import Topology
from ..errors import ConfigError, TopologyError
from ..io.nodefiles import shard_name
from ..io.nodefolder import default_folder, join, node_folder
from ..io.options import ReadOptions
from ..io.shardplan import NodeEpoch, NodeShard
from ..io.urls import is_local
from ..state.elastic import ElasticView
from ..state.spec import PlanSpec
from .stages import PlannedSource

__all__ = ["join_node_folder", "node_schedule", "shard_schedule", "whole_shards"]


def shard_schedule(source: Any) -> Iterator[list[Any]]:
    """Per epoch a stream walks, the shards its DataLoader worker reads whole (its rank's
    own shards under ``locality="shard"``), in order of first use: what
    ``RangeReader.follow`` fetches ahead and drops after the last use. Foreign samples
    (shards dealt to other ranks) are not listed: they stay single ranged reads.

    The schedule is core/local/shardschedule.py's (int64 arrays, O(the rank's share) per epoch);
    here each row becomes the reader's ``PlannedShard`` (URL, size, byte ranges).
    """
    from ..io.shardcache import PlannedShard

    spec: PlanSpec = source.spec
    wid, nw = source._worker()
    epoch, first, counter = source.start.epoch, source.start.index, 0
    rank = spec.topology.rank
    fp = spec.fingerprint()
    shard_of = [ix.shard for ix in spec.indexes]
    while True:
        plan, walk = source.epoch_batches(epoch)
        reads, counter = shard_reads(plan, walk, first, counter, nw, wid, shard_of)
        out = []
        for r in range(len(reads)):
            ix = spec.indexes[int(reads.dataset[r])]
            s, uses = int(reads.shard[r]), reads.uses(r)
            out.append(PlannedShard(
                url=ix.urls[s], size=int(ix.shards[s].size), uses=int(uses.size),
                users=frozenset(np.flatnonzero(reads.users[r]).tolist()), key=f"{fp}:{epoch}:{rank}",
                skip=int(reads.skip[r]), early=int(reads.early[r]),
                ranges=tuple(zip(np.asarray(ix.offset[uses], np.int64).tolist(),
                                 np.asarray(ix.length[uses], np.int64).tolist()))))
        yield out
        if spec.mode is not Mode.STEPS:
            return
        epoch, first = epoch + 1, 0


def node_schedule(source: Any) -> Iterator[NodeEpoch]:
    """Per epoch a stream walks, what the plans of every rank of its node say of it, for
    the node cache (io/nodecache.py): each shard the node reads, whether the node holds
    it, the steps and processes that read it, this process's own reads, and the shards
    the node holds in the next epoch.

    The node's ranks are the topology's (``local_world_size``, CP peers included); each
    one's plan is ``replace(spec, topology=<its topology>)``'s (in an epoch resumed on
    another layout, its elastic view's), which is pure: nothing is asked of the other
    processes. Without a node layout (or with an explicit DP layout) the node is this
    rank alone. Core's ``node_uses`` makes the table; here each row becomes a ``NodeShard``.
    """
    spec = source.spec
    wid, nw = source._worker()
    topo = spec.topology
    lws = topo.local_world_size or 1
    try:
        dps = topo.node_dp_ranks() if topo.local_world_size else [topo.dp_rank]
    except TopologyError:  # an explicit layout: the other ranks' DP ranks are unknown
        dps, lws = [topo.dp_rank], 1
    base = topo.node * lws if lws > 1 else topo.rank
    local = [[r - base for r in range(d * topo.cp_size, (d + 1) * topo.cp_size) if base <= r < base + lws]  # type: ignore[operator]
             for d in dps] if lws > 1 else [[0]]
    me_local = topo.rank - base
    specs = {d: spec if d == topo.dp_rank else replace(spec, topology=Topology(
        topo.world_size, d * topo.cp_size, cp_size=topo.cp_size, local_world_size=topo.local_world_size))  # type: ignore[operator]
        for d in dps}
    me = (dps.index(topo.dp_rank), me_local, wid)  # type: ignore[arg-type]
    shard_of = [ix.shard for ix in spec.indexes]

    def plans(epoch: int) -> list[Plan]:
        view = source.start.view
        if view is not None and view.epoch == epoch:
            return [view.plan if d == topo.dp_rank else ElasticView(view.epoch, view.segments, replace(
                view.spec, topology=specs[d].topology)).plan for d in dps]
        return [specs[d].plan(epoch) for d in dps]

    epoch, first, counter = source.start.epoch, source.start.index, 0
    uses: NodeUses | None = node_uses(plans(epoch), local, first, counter, nw, me, shard_of)
    while uses is not None:
        counter += max(0, uses.length - first)
        later = _Later(spec, lambda e=epoch + 1, c=counter: node_uses(plans(e), local, 0, c, nw, me, shard_of))
        yield _node_epoch(spec, epoch, uses, later, me_local * nw + wid, len(dps))
        if spec.mode is not Mode.STEPS:
            return
        epoch, first, uses = epoch + 1, 0, later.uses()


class _Later(Mapping[str, int]):
    """The shards the node holds in the next epoch (file stem -> the first step it reads
    each), planned ahead on a thread of its own, not in the read that first asks (inline in ``next()``)."""

    def __init__(self, spec: PlanSpec, make: Callable[[], NodeUses]) -> None:
        self._spec, self._make, self._lock = spec, make, threading.Lock()
        self._after: NodeUses | None = None
        self._table: dict[str, int] | None = None
        threading.Thread(target=self._ahead, name="wds_pad-next-epoch", daemon=True).start()

    def _ahead(self) -> None:
        with contextlib.suppress(Exception):  # an error is raised again where the table is asked for
            self._stems()

    def uses(self) -> NodeUses | None:
        """The next epoch's table (None: there is no next epoch)."""
        self._stems()
        return self._after

    def _stems(self) -> dict[str, int]:
        with self._lock:
            if self._table is None:
                table: dict[str, int] = {}
                try:
                    self._after = after = self._make()
                except ConfigError:  # no epoch after the last one
                    after = None
                if after is not None:
                    for r in np.flatnonzero(after.held).tolist():
                        info = self._spec.indexes[int(after.dataset[r])].shards[int(after.shard[r])]
                        table[shard_name(info.url, info.size, info.stamp, info.content)] = int(after.uses(r)[0])
                self._table = table
            return self._table

    def __getitem__(self, stem: str) -> int:
        return self._stems()[stem]

    def __iter__(self) -> Iterator[str]:
        return iter(self._stems())

    def __len__(self) -> int:
        return len(self._stems())


def _node_epoch(spec: PlanSpec, epoch: int, uses: NodeUses, later: Mapping[str, int], me: int,
                ranks: int) -> NodeEpoch:
    """The io record of a node's epoch (``later``: the shards it holds in the next one;
    ``ranks``: the node's DP ranks, whose held shards it shares out)."""
    shards: dict[str, NodeShard] = {}
    firsts = []
    for r in range(len(uses)):
        info = spec.indexes[int(uses.dataset[r])].shards[int(uses.shard[r])]
        mine = uses.mine(r)
        rec = NodeShard(url=info.url, size=int(info.size), name=shard_name(info.url, info.size, info.stamp, info.content),
                        held=bool(uses.held[r]), steps=uses.uses(r),
                        users=frozenset(np.flatnonzero(uses.users[r]).tolist()), mine=mine, content=info.content)
        shards.setdefault(info.url, rec)
        if rec.held and mine.size:
            firsts.append((int(mine[0]), info.url))
    per_rank = max(1, int(uses.held.sum()) // max(1, ranks))
    return NodeEpoch(epoch=epoch, length=uses.length, me=me, shards=shards,
                     order=tuple(url for _, url in sorted(firsts)), later=later,
                     span=max(1, -(-uses.length * spec.window // per_rank)))


@contextlib.contextmanager
def whole_shards(reader: Any, source: PlannedSource) -> Iterator[None]:
    """While the block runs, ``reader`` reads the shards ``source``'s plan reads whole:
    through the node's copies (``cache_dir``, or the job's default folder when the node
    runs several of its processes), else in this process's memory."""
    spec = source.spec
    wid, nw = source._worker()
    folder = node_folder(reader.options.cache_dir, workers=nw, local_world_size=spec.topology.local_world_size)
    if folder is None:
        reader.follow(shard_schedule(source), max_shards=spec.window + 1)
    else:
        reader.follow(node_schedule(source), max_shards=spec.window + 1, folder=folder)
    try:
        yield
    finally:
        reader.shard_cache.close()


def join_node_folder(spec: PlanSpec, options: ReadOptions | None) -> None:
    """In a main process: joins the job's default shard folder, which a stream of remote
    shards read whole without a ``cache_dir`` uses once it runs beside other processes
    of the job (local ranks, DataLoader workers), so the folder lives as long as the
    job and goes with its last process. A ``cache_dir`` no stream uses is said once."""
    if spec.locality is Locality.NONE and options is not None and options.cache_dir is not None:
        warnings.warn(f"ReadOptions(cache_dir={options.cache_dir!r}) is not used with locality='none' (each sample is "
                      "one ranged read; no shard is kept): stream with locality='shard' or 'node' to keep shards "
                      "there, or drop cache_dir", UserWarning, stacklevel=3)
    if spec.locality is Locality.NONE or (options is not None and options.cache_dir is not None):
        return
    if any(ix.urls and not is_local(ix.urls[0]) for ix in spec.indexes):
        join(default_folder())
