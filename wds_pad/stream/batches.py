"""One iteration of a BucketedWebDataset: from this rank's planned batches to what the
trainer receives (fetch, per-sample stages, collation, or a packed batch).

Invariants:
- a batch is exactly the plan's batch: per-sample stages run inside it, one sample to
  one, and ``advance`` is called with ``(epoch, j)`` after batch j is made and before
  it is yielded, so the dataset's cursor always names the next batch;
- local shards are read batch by batch through the member table where it records the
  samples (batchread.py), else on the exact path (fetch.py), with the same samples;
- a batch travels packed (transport.py) only from a DataLoader worker and only when
  nothing but a known collation runs on it: read into the ring (local shards), or its
  fetched members copied into it once (remote shards, the node cache, the exact path);
  ``views`` (``zero_copy`` in one process) hands out members as read-only memoryviews;
- a failed transform is raised naming its sample and shard, or replaced by the
  handler's deterministic substitute from the same bucket.
"""

from __future__ import annotations

from contextlib import nullcontext
from time import perf_counter_ns
from typing import Any, Callable, Iterator

from torch.utils.data import get_worker_info

from ..core.local.locality import Locality
from ..errors import WdsPadError
from .batchcache import BatchCache
from .batchread import BatchReader
from .collate import lists_only, run_collation, where_samples as _where
from .stats import COLLATE, Clock
from .fetch import Counters, all_local as _all_local, substitute
from .stages import PlannedSource, apply_stages, batch_refs, sized_batches
from .wholeshards import whole_shards
from . import mappedbatch
from .ring import RING_BATCHES, Arena, ring_cap
from .transport import LooseBatch, PackedRun, as_views, pack_samples, run_length
from ..state import PlanSpec

__all__ = ["BatchMaker"]


def _sample_bytes(spec: PlanSpec) -> float:
    """The mean byte range of a sample, from the first rows of each index (O(1))."""
    lengths = [ix.length[:4096] for ix in spec.indexes if len(ix)]
    return float(sum(int(x.sum()) for x in lengths) / max(1, sum(x.size for x in lengths)))


class BatchMaker:
    """Makes the batches of one iteration in this process (the main one or a worker).

    Args:
        spec: the plan's identity.
        stages: per-sample stages (``.decode``, ``.map`` ...).
        collation_fn: what a batch is made of its samples (None: collate.py's default).
        handler: webdataset-style handler; True for a failed sample substitutes it.
        counters: the dataset's substitution counters.
        fetcher: this iteration's fetch stage (fetch.py), with its reader.
        advance: called with ``(epoch, j)`` once plan batch j is made.
        pack: send batches packed in shared memory (a DataLoader worker under Loader).
        views: members as read-only memoryviews (``zero_copy`` in one process).
        clock: where collation time is counted (stats.py).
        arenas: the rings of a worker the Loader keeps between epochs, reused (ring.py).
        refs: the Loader's shared flag (a tensor): batches of mapped shards are sent by
            reference while it is 0 (mappedbatch.py; not with ``zero_copy``); None: never.
    """

    def __init__(self, spec: PlanSpec, stages: list[Callable[[Any], Any]],
                 collation_fn: Callable[[list[Any]], Any] | None,
                 handler: Callable[[BaseException], bool] | None, counters: Counters, fetcher: Any,
                 advance: Callable[[tuple[int, int]], Any], pack: bool, views: bool,
                 clock: Clock | None = None, arenas: dict[Any, Arena] | None = None,
                 refs: Any = None) -> None:
        self.clock = clock if clock is not None else Clock()
        self.stamps = self.clock.acc
        # a collation that only lists the samples costs less than reading the clock: not timed;
        # another is timed here, two clock reads around it, so the loop's per-batch timing has no branch
        self.timed_collation = not lists_only(collation_fn, bool(stages))
        self.spec, self.stages, self.collation_fn = spec, stages, collation_fn
        self.handler, self.counters, self.fetcher = handler, counters, fetcher
        self.advance, self.pack, self.views = advance, pack, views
        # a kept worker's rings, across its iterations: of local batches (BatchReader's, keyed by
        # shared), and ``"fetched"``: where batches of fetched samples are packed (pack_samples)
        self.arenas = arenas
        self.refs = refs
        self._ring: Arena | None = None if arenas is None else arenas.get("fetched")

    def __call__(self, source: PlannedSource) -> Iterator[Any]:
        fetcher, pack, views = self.fetcher, self.pack, self.views
        if _all_local(self.spec, fetcher.reader):
            yield from self._local(source)
            return
        # whole remote shards, as planned: the node's copies, or this process's memory (wholeshards.py)
        shards = whole_shards(fetcher.reader, source) if self.spec.locality is not Locality.NONE else nullcontext()
        with shards:
            # (fetched sample, transformed sample), each transformed as it arrives; a batch
            # leaves with its last sample (the plan's size), not at the next batch's first
            pairs = ((s, self._transform(s) if self.stages else s) for s in fetcher(iter(source)))
            for group in sized_batches(pairs, source.batch_len, key=_pair_key):
                refs = [r for r, _ in group]  # the fetched samples: their keys name them in errors
                out = self._collated([b for _, b in group], refs, pack, views)
                self.advance(_pair_key(group[0]))
                yield out

    def _collated(self, batch: list[Any], refs: list[dict[str, Any]], pack: bool, views: bool) -> Any:
        if pack:  # collated where it is unpacked: its members copied once into the ring, else pickled
            self._ring, packed = pack_samples(batch, self._ring, True)
            if self.arenas is not None:
                self.arenas["fetched"] = self._ring
            return LooseBatch(batch) if packed is None else packed
        samples = as_views(batch) if views else batch
        if not self.timed_collation:
            return run_collation(self.collation_fn, samples, _where(refs))
        began = perf_counter_ns()
        out = run_collation(self.collation_fn, samples, _where(refs))
        self.stamps[COLLATE] += perf_counter_ns() - began
        return out

    def _local(self, source: PlannedSource) -> Iterator[Any]:
        """Local shards: batch by batch, through the member table where it records the
        samples (batchread.py), else (or when anything differs) on the exact path; into
        one buffer when the batch travels packed or hands out views (transport.py)."""
        spec, fetcher, pack, views = self.spec, self.fetcher, self.pack, self.views
        info = get_worker_info()
        sample_bytes = _sample_bytes(spec) if pack else 0.0
        large = pack and self.refs is not None and sample_bytes >= mappedbatch.REF_BYTES  # smaller: the ring is faster
        refs = self.refs.numpy() if large else None
        # runs sent by reference carry no payload: as many samples as a run holds, whatever their size;
        # others fill the ring, which a small /dev/shm caps (ring.ring_cap)
        if not pack:
            run = 1
        elif refs is not None:
            run = run_length(spec.batch_size, 0.0)
        else:
            run = run_length(spec.batch_size, sample_bytes, ring_cap(True) // RING_BATCHES)
        source = PlannedSource(spec, source.start, source.worker, run)
        fast = BatchReader(fetcher.reader, spec.names, spec.indexes, self.arenas)
        fast.run, fast.refs = run, refs
        if refs is not None and self.arenas is None:  # a worker of one epoch: it streams each
            fetcher.reader.map_at_once = True  # shard once, and maps it at once to send it by reference
        cache = BatchCache(1 if info is None else info.num_workers, fast, run)
        sending, taken = PackedRun(), 0
        for plan, j in source.batches():
            if pack and taken and not taken % run:  # the last run is sent whole, whatever it holds
                yield sending
                sending = PackedRun()
            taken += 1
            batch = cache.get(plan, j)
            if pack or views:
                packed = fast.read_packed(batch, shared=pack)
                if pack and packed is not None:
                    self.advance((batch.epoch, j))
                    sending.append(packed)
                    continue
                samples = None if packed is None else packed.samples(zero_copy=True)
            else:
                samples = fast.read(batch)
                if samples is not None and batch.pack is not None:  # a Pack: each sample's pack
                    for sample, pk in zip(samples, batch.pack.tolist()):
                        sample["__pack__"] = pk
            exact = samples is None  # its members are bytes
            if exact:
                samples = list(fetcher(iter(batch_refs(spec, plan, j, batch, fast.fallback_members))))
            if not samples:
                continue
            batch_samples = [self._transform(sample) for sample in samples] if self.stages else samples
            out = self._collated(batch_samples, samples, pack, views and exact)
            self.advance((batch.epoch, j))
            if pack:
                sending.append(out)
            else:
                yield out
        if pack and taken:
            yield sending

    def _transform(self, sample: dict[str, Any]) -> Any:
        try:
            return apply_stages(self.stages, sample)
        except Exception as exc:
            if self.handler is None or not self.handler(exc):
                if isinstance(exc, WdsPadError):
                    raise
                raise type(exc)(f"transform failed for sample {sample['__key__']!r} of "
                                f"{sample['__url__']!r}: {exc}") from exc
            message = f"transform failed for sample {sample['__key__']!r} of {sample['__url__']!r}: {exc}"
            ref = {**sample, "__offset__": -1, "__length__": 0}
            alt = substitute(self.spec, self.fetcher.reader, ref, self.counters, message)
            return apply_stages(self.stages, alt)


def _pair_key(pair: tuple[dict[str, Any], Any]) -> tuple[int, int]:
    return pair[0]["__epoch__"], pair[0]["__batch__"]
