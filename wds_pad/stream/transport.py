"""A batch in one buffer: how a batch's members cross from a DataLoader worker, and how
``zero_copy`` members are made.

A :class:`PackedBatch` is one plan batch read into one uint8 buffer: every sample's byte
range, back to back, with per member the start and end of its payload in the buffer,
plus the small per-sample fields (key, shard URL, index row, padded copy). A worker of a
:class:`~wds_pad.stream.loader.Loader` reads its batches of local shards straight into a
buffer in shared memory (a torch uint8 tensor whose storage was made shared: DataLoader
hands it to the main process as a file descriptor, never through the pipe; stream/ring.py)
and sends the packed batch; a batch of fetched samples (remote shards, the node cache,
the exact path) has its members copied into the buffer once (:func:`pack_samples`). The
main process rebuilds the webdataset sample dicts (:meth:`PackedBatch.samples`).

Invariants:
- the rebuilt sample dicts are exactly what the path that read the batch yields for it
  in one process: the same keys in the same order, members in archive order, the same
  ``__``-fields; members are ``bytes`` (copied out of the buffer once: the only copy),
  or with ``zero_copy`` read-only ``memoryview``s over the buffer, which keep it alive
  as long as any of them is held;
- a shared buffer has no name anywhere: torch's default sharing strategy
  (``file_descriptor``) unlinks the segment as soon as it is made, so the kernel frees it
  with the last process that maps it, whichever way the processes end (``kill -9``
  included). Under the ``file_system`` strategy torch's ``torch_shm_manager`` removes
  the names when the job's processes are gone;
- a batch for which the worker can get no shared memory (``/dev/shm`` full) is packed
  into the worker's own memory and pickled with the message instead: the same sample
  dicts, one copy more, and one ``SharedMemoryWarning`` an iteration in the main
  process (stream/ring.py);
- a worker sends its batches of local shards a run at a time (:class:`PackedRun`, of
  :func:`run_length` consecutive plan batches, the runs dealt to the workers in turn),
  so the main process receives them in plan order, one message per run;
- only batches without per-sample stages, collated by a known collation (the default,
  ``list``, webdataset's ``default_collation_fn``) travel packed: collation then runs in
  the main process, on the rebuilt samples, and costs what it costs in one process.
  Anything else (transformed samples, a custom collation, a sample with fields a packed
  batch does not carry) travels as before, pickled by DataLoader.
"""

from __future__ import annotations

import itertools
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch
from webdataset.filters import default_collation_fn

from ..core.planning.plan import user_stacklevel
from ..errors import SharedMemoryWarning
from .collate import collate_batch, collate_columns, run_collation, where_samples
from .ring import HEADER, Arena, release, reserve

__all__ = ["FIELDS", "LooseBatch", "PackedBatch", "PackedRun", "as_views", "pack_samples", "packs", "run_length",
           "unpack", "unpacked"]

RUN_SAMPLES = 256  # a worker sends batches of this many samples in all at once ...
RUN_BYTES = 4 << 20  # ... unless they hold more bytes than this
MAX_RUN = 8


@dataclass
class PackedBatch:
    """One plan batch in one buffer (see the module doc).

    Attributes:
        buf: the buffer the batch lies in (a torch uint8 tensor when shared, else a numpy
            uint8 array): a whole ring, None when the consumer has the ring already.
        ring: the ring's id (None: ``buf`` is the batch's own buffer, at ``start`` 0).
        start, nbytes, seq: where the batch lies in ``buf`` and its place in the ring.
        bounds: int64 ``(2, members)``: each member's payload start and end, from ``start``.
        exts: each member's extension, in archive order, sample after sample.
        counts: members per sample.
        keys, urls, ids, pads: per sample its ``__key__``, ``__url__``, ``__index__``, ``__pad__``.
        seeds: per sample its ``__seed__`` (None: unseeded).
        meta: the batch's ``__bucket__``, ``__dataset__``, ``__epoch__``, ``__step__``, ``__batch__``.
        short: set when shared memory ran out: ``buf`` is the worker's own, pickled through
            the pipe, and this says why (the main process warns once an iteration).
    """

    buf: Any
    ring: Any
    start: int
    nbytes: int
    seq: int
    bounds: np.ndarray
    exts: list[str]
    counts: list[int]
    keys: list[str]
    urls: list[str]
    ids: list[int]
    pads: list[bool]
    meta: tuple[Any, Any, int, int, int]
    packs: list[int] | None = None  # under a Pack: each sample's ``__pack__``
    seeds: list[Any] | None = None  # per sample its ``__seed__`` (core/sampleseed.py)
    short: str | None = None  # why a worker's batch is in its own memory, not shared (ring.Space)

    def __len__(self) -> int:
        return len(self.keys)

    def samples(self, zero_copy: bool = False, rings: dict[Any, np.ndarray] | None = None,
                shards: Any = None) -> list[dict[str, Any]]:
        """The batch's webdataset sample dicts, members ``bytes`` or (``zero_copy``)
        read-only memoryviews over the buffer. ``rings``: the consumer's rings by id
        (this batch's ring is added to it if it carries it); ``shards``: the consumer's
        own mappings, for a batch sent by reference (stream/mappedbatch.py)."""
        whole = self._buffer(rings)
        arr = whole[self.start:self.start + self.nbytes]  # its own object: its views keep it
        if self.ring is not None and zero_copy:  # the ring's space is reused when no view is left
            weakref.finalize(arr, release, whole[:HEADER].view(np.int64), self.seq)
        view = memoryview(arr).toreadonly()
        starts, ends = self.bounds.tolist()
        # every member at once (a view, or its bytes: the one copy), then one dict per sample
        if zero_copy:
            values = [view[a:b] for a, b in zip(starts, ends)]
        else:
            values = [view[a:b].tobytes() for a, b in zip(starts, ends)]
        out = self.dicts(values)
        if self.ring is not None and not zero_copy:  # copied out: its space is free now
            view.release()
            release(whole[:HEADER].view(np.int64), self.seq)
        return out

    def dicts(self, values: list[Any]) -> list[dict[str, Any]]:
        """The batch's sample dicts, its members' values given in archive order, sample
        after sample: one dict per sample, a copy of one template."""
        bucket, dataset, epoch, step, index = self.meta
        tmpl = {"__url__": None, "__key__": None, "__index__": None, "__bucket__": bucket,
                "__dataset__": dataset, "__pad__": False, "__epoch__": epoch, "__step__": step,
                "__batch__": index, "__seed__": None}
        exts = self.exts
        out: list[dict[str, Any]] = []
        append = out.append
        m = 0
        seeds = self.seeds if self.seeds is not None else [None] * len(self.keys)
        for url, key, i, p, cnt, z in zip(self.urls, self.keys, self.ids, self.pads, self.counts, seeds):
            d = tmpl.copy()
            d["__url__"] = url
            d["__key__"] = key
            d["__index__"] = i
            d["__pad__"] = p
            d["__seed__"] = z
            if cnt == 2:  # the common shape (a payload and its .json), unrolled
                d[exts[m]] = values[m]
                d[exts[m + 1]] = values[m + 1]
                m += 2
            else:
                for x in range(m, m + cnt):
                    d[exts[x]] = values[x]
                m += cnt
            append(d)
        if self.packs is not None:
            for d, pk in zip(out, self.packs):
                d["__pack__"] = pk
        return out

    def _buffer(self, rings: dict[Any, np.ndarray] | None) -> np.ndarray:
        buf = self.buf
        if buf is not None:
            arr = buf.numpy() if isinstance(buf, torch.Tensor) else buf
            if self.ring is not None and rings is not None:
                rings[self.ring] = arr
            return arr
        if rings is None or self.ring not in rings:
            raise RuntimeError(f"a packed batch of ring {self.ring} came before the ring itself")
        return rings[self.ring]


class PackedRun(list):  # type: ignore[type-arg]
    """A run of consecutive plan batches of one worker (PackedBatch or LooseBatch each, in
    plan order), sent as one message: DataLoader's cost per message (its queues, a wake-up
    of each process, a pickle) is paid once per run. Every run the worker is dealt is sent,
    empty or short ones too, so DataLoader's round-robin keeps plan order."""


def run_length(batch_size: Any, sample_bytes: float, most: int = RUN_BYTES) -> int:
    """Plan batches a worker sends in one message (``PlannedSource``'s ``run``): enough for
    ``RUN_SAMPLES`` samples, at most ``most`` bytes of them (``RUN_BYTES``; less where a
    ring is capped by the free shared memory: a ring holds ``RING_BATCHES`` messages), from
    1 to ``MAX_RUN``; 1 for a budget (its batches' sizes vary). ``sample_bytes``: the mean
    byte range of a sample."""
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        return 1
    by_count = -(-RUN_SAMPLES // batch_size)
    by_bytes = int(min(RUN_BYTES, most) // max(1.0, batch_size * float(sample_bytes)))
    return max(1, min(MAX_RUN, by_count, by_bytes))


class LooseBatch(list):  # type: ignore[type-arg]
    """A batch of sample dicts read on the exact path, sent uncollated beside packed
    batches (pickled, as before): the main process collates it as it collates those."""


_PACKABLE = (None, collate_batch, collate_columns, default_collation_fn, list)


def packs(stages: Sequence[Callable[[Any], Any]], collation_fn: Any) -> bool:
    """Whether batches with these stages and this collation travel packed (module doc)."""
    return not stages and any(collation_fn is c for c in _PACKABLE)


#: the fields a packed batch carries per sample, in the order every path yields them
FIELDS = ("__url__", "__key__", "__index__", "__bucket__", "__dataset__", "__pad__", "__epoch__", "__step__",
          "__batch__", "__seed__")


def pack_samples(samples: list[Any], arena: Arena | None, shared: bool) -> tuple[Arena | None, PackedBatch | None]:
    """A batch of fetched sample dicts (remote shards, the node cache, the exact path)
    copied once into ``arena`` (made or replaced as :func:`reserve` does): the reader's
    ring and the packed batch, or None when a sample carries what a packed batch does
    not (a substitute's fields, a pack, a member that is not ``bytes``): it travels loose."""
    exts: list[str] = []
    values: list[bytes] = []
    counts: list[int] = []
    nf = len(FIELDS)
    for s in samples:
        if type(s) is not dict or len(s) < nf or tuple(itertools.islice(s, nf)) != FIELDS:
            return arena, None
        n = len(s) - nf
        for k, v in itertools.islice(s.items(), nf, None):
            if type(v) is not bytes or k.startswith("__"):
                return arena, None
            exts.append(k)
            values.append(v)
        counts.append(n)
    if not samples:
        return arena, None
    sizes = list(map(len, values))
    ends = list(itertools.accumulate(sizes))
    nbytes = ends[-1] if ends else 0
    space = reserve(arena, shared, nbytes)
    view = memoryview(space.arr)
    for v, e, n in zip(values, ends, sizes):
        view[e - n:e] = v
    space.sent()
    first = samples[0]
    starts = [e - n for e, n in zip(ends, sizes)]
    return space.arena, PackedBatch(
        space.buf, space.ring, space.start, nbytes, space.seq, np.array([starts, ends], np.int64).reshape(2, -1),
        exts, counts, [s["__key__"] for s in samples], [s["__url__"] for s in samples],
        [s["__index__"] for s in samples], [s["__pad__"] for s in samples],
        (first["__bucket__"], first["__dataset__"], first["__epoch__"], first["__step__"], first["__batch__"]),
        None, [s["__seed__"] for s in samples], space.short)


def as_views(samples: list[Any]) -> list[Any]:
    """``zero_copy`` for samples read on another path: their ``bytes`` members as
    read-only memoryviews (no copy), so every batch hands out the same types."""
    for s in samples:
        if isinstance(s, dict):
            for k, v in s.items():
                if type(v) is bytes and not k.startswith("__"):
                    s[k] = memoryview(v)
    return samples


def unpacked(item: Any, collation_fn: Any, zero_copy: bool, rings: dict[Any, np.ndarray],
             shards: Any = None) -> Iterator[Any]:
    """The batches of one message from a worker (a PackedRun, or one batch), unpacked."""
    for batch in item if isinstance(item, PackedRun) else (item,):
        yield unpack(batch, collation_fn, zero_copy, rings, shards)


_SHORT = "short of shared memory: warned"  # a mark in an iteration's ``rings``, beside the rings' ids


def unpack(batch: Any, collation_fn: Any, zero_copy: bool, rings: dict[Any, np.ndarray], shards: Any = None) -> Any:
    """In the main process: a batch as the dataset yields it in one process. ``rings``:
    the workers' rings seen so far in this iteration, by id; ``shards``: the main
    process's own mappings (stream/mappedbatch.py), for batches sent by reference."""
    if isinstance(batch, (PackedBatch, LooseBatch)):
        if isinstance(batch, PackedBatch):
            if batch.short is not None and _SHORT not in rings:  # once an iteration
                rings[_SHORT] = True
                warnings.warn(SharedMemoryWarning(
                    f"Loader: {batch.short}. Its batches now cross through the pipe, a copy more each "
                    "(slower, the same samples). Give shared memory more room (in a container: docker run "
                    "--shm-size=2g, or a Kubernetes emptyDir volume with medium: Memory on /dev/shm), or "
                    "use fewer workers or smaller batches"), stacklevel=user_stacklevel())
            samples = batch.samples(zero_copy, rings, shards)
        else:
            samples = as_views(list(batch)) if zero_copy else list(batch)
        return run_collation(collation_fn, samples, where_samples(samples))
    return batch
