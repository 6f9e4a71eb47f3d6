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
  so DataLoader's round-robin hands the trainer batches in plan order for any N;
- ``PlannedSource`` starts at a ``Cursor`` (``Position(epoch, index)``; state/cursor.py), a
  seek into the plan: resuming there reads no earlier batch; a cursor in an epoch resumed
  on another layout walks its elastic view's plan instead of the epoch's;
- ``plan_batched`` groups exactly the plan's batches (by ``__epoch__`` and ``__batch__``)
  and collates them by the one rule of collate.py;
- no randomness and no I/O here beyond loading an index: everything comes from the plan.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np

from ..core.plan import Plan
from ..core.shardschedule import shard_reads
from ..core.policy import Mode
from ..errors import ConfigError
from ..index.record import Index
from ..state.cursor import Cursor, Position  # noqa: F401 - Position: also an old stream.stages name
from ..state.spec import PlanSpec, _IndexRef  # noqa: F401 - also the old stream.stages names
from ..tar.members import KEY_ERRORS
from .batchread import BatchCache, BatchReader, member_refs
from .collate import run_collation

__all__ = ["PlannedSource", "plan_batched", "shard_schedule"]


class PlannedSource:
    """Source stage: this rank's planned sample references, for this DataLoader worker.

    Each reference is a dict with ``__url__``, ``__key__``, ``__bucket__``,
    ``__dataset__``, ``__pad__``, ``__epoch__``, ``__step__``, ``__batch__`` (index in
    the rank's plan), ``__index__`` (sample id), ``__offset__`` and ``__length__``.

    Args:
        spec: the PlanSpec.
        start: where to begin (a Cursor, ``Position(epoch, index)``); epochs mode stops at
            the end of ``start.epoch``, steps mode runs on across epochs. A cursor with an
            elastic view (a resumed epoch on another layout) walks the view's plan in
            its epoch.
        worker: (worker_id, num_workers); default: from torch's get_worker_info().
    """

    def __init__(self, spec: PlanSpec, start: Cursor | None = None,
                 worker: tuple[int, int] | None = None) -> None:
        self.spec = spec
        self.start = start or Cursor()
        self.worker = worker

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
        epoch, first = self.start.epoch, self.start.index
        counter = 0
        while True:
            plan, walk = self.epoch_batches(epoch)
            if first > len(walk):
                raise ConfigError(f"resume position {first} is past the end of epoch {epoch} "
                                  f"({len(walk)} batches on this rank)")
            for k in range(first, len(walk)):
                if counter % nw == wid:
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
    """The sample references of batch ``j`` of ``plan`` (``batch``: ``plan[j]``, if known);
    with ``members`` (batchread.member_refs), each reference carries its sample's under
    ``__members__``, and ``fetch`` slices its bytes without parsing tar headers."""
    batch = plan[j] if batch is None else batch
    ds = plan.datasets.index(batch.dataset)
    ix = spec.indexes[ds]
    ids = batch.samples
    shards, offsets, lengths = ix.shard[ids], ix.offset[ids], ix.length[ids]
    urls = ix.urls
    refs = [
        {"__url__": urls[s], "__key__": k, "__offset__": o, "__length__": n,
         "__index__": i, "__bucket__": batch.bucket, "__dataset__": batch.dataset, "__pad__": p,
         "__epoch__": batch.epoch, "__step__": batch.step, "__batch__": j}
        for i, k, s, o, n, p in zip(ids.tolist(), _keys(ix, ids), shards.tolist(), offsets.tolist(),
                                    lengths.tolist(), batch.pad.tolist())
    ]
    if members is not None:
        for ref, m in zip(refs, members):
            ref["__members__"] = m
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

    The schedule is core/shardschedule.py's (int64 arrays, O(the rank's share) per epoch);
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
