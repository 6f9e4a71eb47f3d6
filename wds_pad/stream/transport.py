"""A batch in one buffer: how a batch's members cross from a DataLoader worker, and how
``zero_copy`` members are made.

A :class:`PackedBatch` is one plan batch read into one uint8 buffer: every sample's byte
range, back to back, with per member the start and end of its payload in the buffer,
plus the small per-sample fields (key, shard URL, index row, padded copy). A worker of a
:class:`~wds_pad.stream.loader.Loader` reads its batches straight into a buffer in
shared memory (a torch uint8 tensor whose storage was made shared: DataLoader hands it
to the main process as a file descriptor, never through the pipe) and sends the packed
batch; the main process rebuilds the webdataset sample dicts (:meth:`PackedBatch.samples`).

Invariants:
- the rebuilt sample dicts are exactly what the batch-wise path yields for the batch in
  one process: the same keys in the same order, members in archive order, the same
  ``__``-fields; members are ``bytes`` (copied out of the buffer once: the only copy),
  or with ``zero_copy`` read-only ``memoryview``s over the buffer, which keep it alive
  as long as any of them is held;
- a shared buffer has no name anywhere: torch's default sharing strategy
  (``file_descriptor``) unlinks the segment as soon as it is made, so the kernel frees it
  with the last process that maps it, whichever way the processes end (``kill -9``
  included). Under the ``file_system`` strategy torch's ``torch_shm_manager`` removes
  the names when the job's processes are gone;
- a worker sends its batches of local shards a run at a time (:class:`PackedRun`, of
  :func:`run_length` consecutive plan batches, the runs dealt to the workers in turn),
  so the main process receives them in plan order, one message per run;
- only batches without per-sample stages, collated by a known collation (the default,
  ``list``, webdataset's ``default_collation_fn``) travel packed: collation then runs in
  the main process, on the rebuilt samples, and costs what it costs in one process.
  Anything else (transformed samples, a custom collation, a batch read on the exact
  path) travels as before, pickled by DataLoader.
"""

from __future__ import annotations

import collections
import itertools
import os
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch
from webdataset.filters import default_collation_fn

from .collate import collate_batch, collate_columns, run_collation, where_samples

__all__ = ["Arena", "LooseBatch", "PackedBatch", "PackedRun", "allocate", "as_views", "packs", "place", "ring_bytes",
           "run_length", "unpack", "unpacked"]


ARENA_BYTES = 64 << 20  # the largest ring of batch buffers a reader makes, its pages reused
RING_BYTES = 4 << 20  # the smallest: a ring is sized to the batches it carries (ring_bytes)
RING_BATCHES = 4  # a ring holds this many messages of batches the size of the one it is made
# for: a worker's two prefetched ones (DataLoader's default), the one it makes, the trainer's
RUN_SAMPLES = 256  # a worker sends batches of this many samples in all at once ...
RUN_BYTES = 4 << 20  # ... unless they hold more bytes than this
MAX_RUN = 8
SLOTS = 256  # batches a ring can hold at once (one release flag each, at the ring's start)
_HEADER = 8 * SLOTS
_IDS = itertools.count()


def allocate(nbytes: int, shared: bool) -> tuple[Any, np.ndarray]:
    """A buffer of ``nbytes`` and a writable uint8 numpy view of it.

    ``shared``: a torch uint8 tensor whose storage is born in shared memory (pickling it
    into the main process passes a descriptor, no copy); else a plain numpy array.
    """
    if not shared:
        arr = np.empty(nbytes, np.uint8)
        return arr, arr
    size = max(1, nbytes)
    try:
        storage = torch.UntypedStorage._new_shared(size)
        tensor = torch.empty(0, dtype=torch.uint8).set_(storage)  # type: ignore[call-overload]
    except (AttributeError, TypeError, RuntimeError):  # another torch: shared after the fact
        tensor = torch.empty(size, dtype=torch.uint8).share_memory_()
    tensor = tensor[:nbytes]
    return tensor, tensor.numpy()


def ring_bytes(nbytes: int, size: int = 0, run: int = 1) -> int:
    """The size of a ring for batches of about ``nbytes`` sent ``run`` at a time, or of the
    ring that replaces a full one of ``size``: room for ``RING_BATCHES`` runs of them, twice
    the full one, between ``RING_BYTES`` and ``ARENA_BYTES``. Every page of a ring is
    touched once (a page fault in the worker and in the main process), so it is no larger
    than what is in flight: a worker's prefetched batches and the ones the trainer holds."""
    return min(ARENA_BYTES, max(RING_BYTES, RING_BATCHES * max(1, run) * nbytes, 2 * size))


class Arena:
    """A ring of batch buffers, made once per reader: fresh (shared) memory costs a page
    fault a page, a reused ring nothing.

    Batches are placed one after the other and wrap around; the consumer marks a batch
    done in the ring's flags (``SLOTS`` int64 at its start, :func:`_release`) when no
    member of it is held any more, and the ring reuses its space from the oldest batch
    on. A batch that does not fit (the oldest still held, or larger than half the ring)
    gets a buffer of its own; a reader whose ring is full replaces it with a larger one
    (:func:`ring_bytes`), the consumer keeps the old one as long as a batch of it is held.
    """

    def __init__(self, shared: bool, size: int = ARENA_BYTES) -> None:
        self.shared = shared
        self.size = size
        self.owner, self.arr = allocate(size + _HEADER, shared)
        self.flags = self.arr[:_HEADER].view(np.int64)
        self.flags[:] = 0
        self.id = (os.getpid(), next(_IDS))
        self.sent = False  # the ring itself went to the consumer with its first batch
        self.live: collections.deque[tuple[int, int, int]] = collections.deque()  # (seq, start, end)
        self.head = _HEADER
        self.seq = 0

    def alloc(self, nbytes: int) -> tuple[np.ndarray, int, int] | None:
        """``(view, start, seq)`` of ``nbytes`` in the ring, or None: it does not fit now."""
        live, flags, size = self.live, self.flags, self.arr.size
        while live and flags[live[0][0] % SLOTS] == live[0][0] + 1:
            live.popleft()
        n = max(1, nbytes)
        if len(live) >= SLOTS - 1 or n > (size - _HEADER) // 2:
            return None
        if not live:
            self.head = start = _HEADER
        else:
            tail, head = live[0][1], self.head
            if head >= tail:  # in use: [tail, head); free: after head, then before tail
                start = head if head + n <= size else (_HEADER if _HEADER + n <= tail else -1)
            else:  # in use: [tail, size) and [HEADER, head)
                start = head if head + n <= tail else -1
            if start < 0:
                return None
        seq = self.seq
        self.seq += 1
        flags[seq % SLOTS] = 0
        live.append((seq, start, start + n))
        self.head = start + n
        return self.arr[start:start + nbytes], start, seq


    def release(self, seq: int) -> None:
        """Give batch ``seq``'s space back now (it was not handed out)."""
        _release(self.flags, seq)


def place(arena: Arena | None, shared: bool, nbytes: int,
          run: int = 1) -> tuple[Arena, tuple[np.ndarray, int, int] | None]:
    """Where a reader puts a batch of ``nbytes`` (sent ``run`` at a time): its ring (made now
    for this process if ``arena`` is None or another process's; a larger one if it is full)
    and the batch's place there (:meth:`Arena.alloc`), or None: a buffer of its own."""
    if arena is None or arena.id[0] != os.getpid():
        arena = Arena(shared, ring_bytes(nbytes, run=run))
    got = arena.alloc(nbytes)
    if got is None and arena.size < ARENA_BYTES and 2 * nbytes <= ARENA_BYTES:
        arena = Arena(shared, ring_bytes(nbytes, arena.size))
        got = arena.alloc(nbytes)
    return arena, got


def _release(flags: np.ndarray, seq: int) -> None:
    flags[seq % SLOTS] = seq + 1


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

    def __len__(self) -> int:
        return len(self.keys)

    def samples(self, zero_copy: bool = False, rings: dict[Any, np.ndarray] | None = None) -> list[dict[str, Any]]:
        """The batch's webdataset sample dicts, members ``bytes`` or (``zero_copy``)
        read-only memoryviews over the buffer. ``rings``: the consumer's rings by id
        (this batch's ring is added to it if it carries it)."""
        whole = self._buffer(rings)
        arr = whole[self.start:self.start + self.nbytes]  # its own object: its views keep it
        if self.ring is not None and zero_copy:  # the ring's space is reused when no view is left
            weakref.finalize(arr, _release, whole[:_HEADER].view(np.int64), self.seq)
        view = memoryview(arr).toreadonly()
        bucket, dataset, epoch, step, index = self.meta
        tmpl = {"__url__": None, "__key__": None, "__index__": None, "__bucket__": bucket,
                "__dataset__": dataset, "__pad__": False, "__epoch__": epoch, "__step__": step,
                "__batch__": index}
        starts, ends = self.bounds.tolist()
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
            j = m + cnt
            if zero_copy:
                for x in range(m, j):
                    d[exts[x]] = view[starts[x]:ends[x]]
            else:
                for x in range(m, j):
                    d[exts[x]] = view[starts[x]:ends[x]].tobytes()
            m = j
            append(d)
        if self.packs is not None:
            for d, pk in zip(out, self.packs):
                d["__pack__"] = pk
        if self.ring is not None and not zero_copy:  # copied out: its space is free now
            view.release()
            _release(whole[:_HEADER].view(np.int64), self.seq)
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


def run_length(batch_size: Any, sample_bytes: float) -> int:
    """Plan batches a worker sends in one message (``PlannedSource``'s ``run``): enough for
    ``RUN_SAMPLES`` samples, at most ``RUN_BYTES`` of them, from 1 to ``MAX_RUN``; 1 for a
    budget (its batches' sizes vary). ``sample_bytes``: the mean byte range of a sample."""
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        return 1
    by_count = -(-RUN_SAMPLES // batch_size)
    by_bytes = int(RUN_BYTES // max(1.0, batch_size * float(sample_bytes)))
    return max(1, min(MAX_RUN, by_count, by_bytes))


class LooseBatch(list):  # type: ignore[type-arg]
    """A batch of sample dicts read on the exact path, sent uncollated beside packed
    batches (pickled, as before): the main process collates it as it collates those."""


_PACKABLE = (None, collate_batch, collate_columns, default_collation_fn, list)


def packs(stages: Sequence[Callable[[Any], Any]], collation_fn: Any) -> bool:
    """Whether batches with these stages and this collation travel packed (module doc)."""
    return not stages and any(collation_fn is c for c in _PACKABLE)


def as_views(samples: list[Any]) -> list[Any]:
    """``zero_copy`` for samples read on another path: their ``bytes`` members as
    read-only memoryviews (no copy), so every batch hands out the same types."""
    for s in samples:
        if isinstance(s, dict):
            for k, v in s.items():
                if type(v) is bytes and not k.startswith("__"):
                    s[k] = memoryview(v)
    return samples


def unpacked(item: Any, collation_fn: Any, zero_copy: bool, rings: dict[Any, np.ndarray]) -> Iterator[Any]:
    """The batches of one message from a worker (a PackedRun, or one batch), unpacked."""
    for batch in item if isinstance(item, PackedRun) else (item,):
        yield unpack(batch, collation_fn, zero_copy, rings)


def unpack(batch: Any, collation_fn: Any, zero_copy: bool, rings: dict[Any, np.ndarray]) -> Any:
    """In the main process: a batch as the dataset yields it in one process. ``rings``:
    the workers' rings seen so far in this iteration, by id."""
    if isinstance(batch, (PackedBatch, LooseBatch)):
        if isinstance(batch, PackedBatch):
            samples = batch.samples(zero_copy, rings)
        else:
            samples = as_views(list(batch)) if zero_copy else list(batch)
        return run_collation(collation_fn, samples, where_samples(samples))
    return batch
