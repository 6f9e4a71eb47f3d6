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
- a batch's size is the plan's (``PlannedSource.batch_len``): ``plan_batched`` given the
  source hands a batch out with its last sample, not at the next batch's first;
- no randomness and no I/O here beyond loading an index: everything comes from the plan.
  What a stream reads whole (its shard or node schedule) is wholeshards.py's.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np

from ..core.planning.plan import Plan
from ..core.policy import Mode
from ..errors import ConfigError
from ..index.record import Index
from ..state.cursor import Cursor
from ..state.spec import PlanSpec
from ..tar.members import KEY_ERRORS
from .batchcache import BatchCache
from .batchread import BatchReader, member_refs, seed_list
from .collate import run_collation

__all__ = ["PlannedSource", "apply_stages", "batch_refs", "plan_batched", "sized_batches"]


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

    def batch_len(self, epoch: int, j: int) -> int:
        """The samples of batch ``j`` of ``epoch`` as this source walks it (its references'
        ``__epoch__`` and ``__batch__``): where a batching stage ends the batch."""
        offsets = self.epoch_batches(epoch)[0].offsets
        return int(offsets[j + 1] - offsets[j])

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


def plan_batched(collation_fn: Callable[[list[Any]], Any] | None = None, *,
                 source: PlannedSource | None = None) -> Callable[[Iterable[dict[str, Any]]], Iterator[Any]]:
    """Stage grouping samples into the plan's batches (by ``__epoch__``/``__batch__``).

    Place it before stages that drop the ``__`` keys (e.g. ``to_tuple``), or use
    ``BucketedWebDataset``, which applies per-sample transforms inside each batch.

    Args:
        collation_fn: what a batch is made of its samples; None: the list of sample
            dicts (the rule of collate.py, as in ``BucketedWebDataset``). webdataset's
            ``default_collation_fn`` gets the checked version, which raises a
            ``ConfigError`` naming the sample whose members differ instead of asserting.
        source: the pipeline's ``PlannedSource``: a batch is handed out with its last
            sample (the plan says how many it has). Without it a batch ends when the
            next batch's first sample arrives, a wait for one more read of remote shards.
    """
    return _PlanBatched(collation_fn, source)


class _PlanBatched:
    def __init__(self, collation_fn: Callable[[list[Any]], Any] | None, source: PlannedSource | None) -> None:
        self.collation_fn, self.source = collation_fn, source

    def __call__(self, src: Iterable[dict[str, Any]]) -> Iterator[Any]:
        if self.source is None:
            for _, group in itertools.groupby(src, key=_batch_key):
                yield run_collation(self.collation_fn, list(group))
            return
        for batch in sized_batches(src, self.source.batch_len):
            yield run_collation(self.collation_fn, batch)


def sized_batches(samples: Iterable[Any], batch_len: Callable[[int, int], int],
                  key: Callable[[Any], tuple[int, int]] | None = None) -> Iterator[list[Any]]:
    """The samples as the plan's batches, each out with its last sample (``batch_len(epoch,
    j)`` samples, ``key``: a sample's ``(epoch, j)``, default its ``__epoch__`` and
    ``__batch__``); a batch cut short (a stage dropped a sample) ends at the next one's first."""
    key_of = _batch_key if key is None else key
    batch: list[Any] = []
    current, want = None, 0
    for sample in samples:
        key = key_of(sample)
        if key != current:
            if batch:
                yield batch
            batch, current, want = [], key, batch_len(*key)
        batch.append(sample)
        if len(batch) == want:
            yield batch
            batch = []
    if batch:
        yield batch


def _batch_key(sample: dict[str, Any]) -> tuple[Any, Any]:
    try:
        return sample["__epoch__"], sample["__batch__"]
    except (KeyError, TypeError) as exc:
        keys = sorted(sample) if isinstance(sample, dict) else type(sample).__name__
        raise ConfigError(f"plan_batched() got a sample without '__epoch__' and '__batch__' ({keys}): "
                          "place it before stages that drop the '__' keys (such as to_tuple), "
                          "and do that inside collation_fn") from exc


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
