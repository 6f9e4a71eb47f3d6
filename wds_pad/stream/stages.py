"""The plan side of the bucketed path: what to stream, where, and how it is batched.

``wds.DataPipeline(PlannedSource(spec), fetch(), wds.decode("pil"), plan_batched())``
streams this rank's plan: ``PlannedSource`` and ``plan_batched`` are here, ``fetch`` (the
read side) is in fetch.py. Stages are generators over the stream (webdataset style),
configured by small picklable objects so they travel into DataLoader workers.

Invariants:
- ``PlanSpec`` (state/spec.py) holds everything the plan depends on and recomputes the
  identical plan in every process (DataLoader workers too);
- ``PlannedSource`` yields this rank's planned sample references in exact plan order;
  with N DataLoader workers, worker w yields plan batches j with (j - start) mod N == w,
  so DataLoader's round-robin hands the trainer batches in plan order for any N; with
  ``run`` R (a worker that sends R batches at a time, transport.py), runs of R
  consecutive batches are dealt instead: ((j - start) div R) mod N == w;
- ``PlannedSource`` starts at a ``Cursor`` (``Position(epoch, index)``; state/cursor.py), a
  seek into the plan: resuming there reads no earlier batch; a cursor in an epoch resumed
  on another layout walks its elastic view's plan instead of the epoch's;
- ``plan_batched`` groups exactly the plan's batches (by ``__epoch__`` and ``__batch__``)
  and collates them by the one rule of collate.py;
- ``shard_schedule`` and ``node_schedule`` turn core's int64 schedules into the reader's
  records (io/shardplan.py); ``whole_shards`` sets the reader on one of them: the node's
  copies when the node's processes share a folder, else this process's memory;
- no randomness and no I/O here beyond loading an index and naming the node's folder:
  everything comes from the plan.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import warnings
from collections.abc import Mapping
from dataclasses import replace
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np

from ..core.local.locality import Locality
from ..core.planning.plan import Plan
from ..core.local.shardschedule import NodeUses, node_uses, shard_reads
from ..core.policy import Mode
from ..core.topology import Topology
from ..errors import ConfigError, TopologyError
from ..index.record import Index
from ..io.nodefiles import shard_name
from ..io.nodefolder import default_folder, join, node_folder
from ..io.options import ReadOptions
from ..io.shardplan import NodeEpoch, NodeShard
from ..io.urls import is_local
from ..state.elastic import ElasticView
from ..state.cursor import Cursor
from ..state.spec import PlanSpec
from ..tar.members import KEY_ERRORS
from .batchcache import BatchCache
from .batchread import BatchReader, member_refs, seed_list
from .collate import run_collation

__all__ = ["PlannedSource", "apply_stages", "node_schedule", "plan_batched", "shard_schedule", "whole_shards"]


class PlannedSource:
    """Source stage: this rank's planned sample references, for this DataLoader worker.

    Each reference is a dict with ``__url__``, ``__key__``, ``__bucket__``,
    ``__dataset__``, ``__pad__``, ``__epoch__``, ``__step__``, ``__batch__`` (index in
    the rank's plan), ``__index__`` (sample id), ``__seed__``, ``__offset__``, ``__length__`` (``__pack__``: a Pack's).

    Args:
        spec: the PlanSpec.
        start: where to begin (a Cursor, ``Position(epoch, index)``); epochs mode stops at
            the end of ``start.epoch``, steps mode runs on across epochs. A cursor with an
            elastic view (a resumed epoch on another layout) walks the view's plan in
            its epoch.
        worker: (worker_id, num_workers); default: from torch's get_worker_info().
        run: consecutive batches a worker takes in turn (1: every num_workers-th batch).
    """

    def __init__(self, spec: PlanSpec, start: Cursor | None = None,
                 worker: tuple[int, int] | None = None, run: int = 1) -> None:
        self.spec, self.start, self.worker, self.run = spec, start or Cursor(), worker, max(1, int(run))

    def _worker(self) -> tuple[int, int]:
        if self.worker is not None:
            return self.worker
        try:
            from torch.utils.data import get_worker_info
        except ImportError:  # pragma: no cover
            return 0, 1
        info = get_worker_info()
        return (0, 1) if info is None else (info.id, info.num_workers)

    def epoch_batches(self, epoch: int) -> tuple[Plan, Sequence[int]]:
        """The plan of ``epoch`` and the indices of its batches this stream walks: the
        start's elastic view in the epoch it covers (what is left of it on this layout,
        its batches indexed from 0), else the epoch's plan; every batch of it."""
        view = self.start.view
        plan = view.plan if view is not None and view.epoch == epoch else self.spec.plan(epoch)
        return plan, range(len(plan))

    def batches(self) -> Iterator[tuple[Plan, int]]:
        """(plan, batch index) of every batch this worker produces, in plan order."""
        wid, nw = self._worker()
        run = self.run
        epoch, first = self.start.epoch, self.start.index
        counter = 0
        while True:
            plan, walk = self.epoch_batches(epoch)
            if first > len(walk):
                raise ConfigError(f"resume position {first} is past the end of epoch {epoch} "
                                  f"({len(walk)} batches on this rank)")
            for k in range(first, len(walk)):
                if (counter // run) % nw == wid:
                    yield plan, int(walk[k])
                counter += 1
            if self.spec.mode is not Mode.STEPS:
                return
            if len(plan) == 0 and first == 0:
                raise ConfigError("steps mode has nothing to stream: every bucket was dropped; "
                                  "lower batch_size or pass oversubscribe=True")
            epoch, first = epoch + 1, 0

    def __iter__(self) -> Iterator[dict[str, Any]]:
        spec = self.spec
        # batches computed a chunk at a time, with their member work (what fetch needs to
        # slice each sample's bytes without parsing its tar headers)
        members = BatchReader(None, spec.names, spec.indexes)
        cache = BatchCache(self._worker()[1], members)
        for plan, j in self.batches():
            batch = cache.get(plan, j)
            work = members.take(batch)
            yield from batch_refs(spec, plan, j, batch, None if work is None else member_refs(work))

    def __call__(self) -> Iterator[dict[str, Any]]:
        return iter(self)


def batch_refs(spec: PlanSpec, plan: Plan, j: int, batch: Any = None,
               members: list[Any] | None = None) -> list[dict[str, Any]]:
    """The sample references of batch ``j`` of ``plan`` (``batch``: ``plan[j]``, if known); with ``members``
    (batchread.member_refs) each carries its sample's under ``__members__`` (``fetch`` parses no header)."""
    batch = plan[j] if batch is None else batch
    ds = plan.datasets.index(batch.dataset)
    ix = spec.indexes[ds]
    ids = batch.samples
    shards, offsets, lengths = ix.shard[ids], ix.offset[ids], ix.length[ids]
    urls = ix.urls
    refs = [
        {"__url__": urls[s], "__key__": k, "__offset__": o, "__length__": n,
         "__index__": i, "__bucket__": batch.bucket, "__dataset__": batch.dataset, "__pad__": p,
         "__epoch__": batch.epoch, "__step__": batch.step, "__batch__": j, "__seed__": z}
        for i, k, s, o, n, p, z in zip(ids.tolist(), _keys(ix, ids), shards.tolist(), offsets.tolist(),
                                       lengths.tolist(), batch.pad.tolist(), seed_list(batch))
    ]
    if members is not None:
        for ref, m in zip(refs, members):
            ref["__members__"] = m
    for ref, pk in zip(refs, () if batch.pack is None else batch.pack.tolist()):  # a Pack: each sample's pack
        ref["__pack__"] = pk
    return refs


def _keys(ix: Index, ids: np.ndarray) -> list[str]:
    """``[ix.key(i) for i in ids]`` with one gather per batch instead of numpy calls per sample
    (decoded as ``Index.key`` decodes, ``tar.members.key_text``)."""
    ko = ix.arrays["key_offsets"]
    table = memoryview(ix.arrays["keys"])
    return [str(table[a:b], "utf-8", KEY_ERRORS) for a, b in zip(ko[ids].tolist(), ko[ids + 1].tolist())]


def plan_batched(collation_fn: Callable[[list[Any]], Any] | None = None) -> Callable[[Iterable[dict[str, Any]]], Iterator[Any]]:
    """Stage grouping samples into the plan's batches (by ``__epoch__``/``__batch__``).

    Place it before stages that drop the ``__`` keys (e.g. ``to_tuple``), or use
    ``BucketedWebDataset``, which applies per-sample transforms inside each batch.

    Args:
        collation_fn: what a batch is made of its samples; None: the list of sample
            dicts (the rule of collate.py, as in ``BucketedWebDataset``). webdataset's
            ``default_collation_fn`` gets the checked version, which raises a
            ``ConfigError`` naming the sample whose members differ instead of asserting.
    """
    return _PlanBatched(collation_fn)


class _PlanBatched:
    def __init__(self, collation_fn: Callable[[list[Any]], Any] | None) -> None:
        self.collation_fn = collation_fn

    def __call__(self, src: Iterable[dict[str, Any]]) -> Iterator[Any]:
        for _, group in itertools.groupby(src, key=_batch_key):
            yield run_collation(self.collation_fn, list(group))


def _batch_key(sample: dict[str, Any]) -> tuple[Any, Any]:
    try:
        return sample["__epoch__"], sample["__batch__"]
    except (KeyError, TypeError) as exc:
        keys = sorted(sample) if isinstance(sample, dict) else type(sample).__name__
        raise ConfigError(f"plan_batched() got a sample without '__epoch__' and '__batch__' ({keys}): "
                          "place it before stages that drop the '__' keys (such as to_tuple), "
                          "and do that inside collation_fn") from exc


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


def apply_stages(stages: Sequence[Callable[[Any], Any]], sample: Any) -> Any:
    """Run webdataset stages over one sample; exactly one sample must come out."""
    it: Any = iter((sample,))
    for stage in stages:
        it = stage(it)
    out = list(it)
    if len(out) != 1:
        raise ConfigError(
            f"a transform turned sample {sample.get('__key__')!r} into {len(out)} samples; "
            "BucketedWebDataset keeps the plan's batches exact, so transforms must map one "
            "sample to one (filter with a handler that substitutes, not with select)"
        )
    return out[0]
