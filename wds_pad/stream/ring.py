"""Rings of batch buffers: where a reader writes the batches it sends (transport.py).

A reader (a DataLoader worker, or one process handing out ``zero_copy`` views) makes one
ring per iteration and reuses its pages: fresh (shared) memory costs a page fault a page,
a reused ring nothing.

Invariants:
- a batch's space is reused only after the consumer marked it done in the ring's flags
  (``SLOTS`` int64 at the ring's start, :func:`release`): when no member of it is held;
- a batch the ring cannot hold now gets a buffer of its own; a reader whose ring is full
  replaces it with one twice as large (:func:`ring_bytes`), from ``RING_BYTES`` to
  ``ARENA_BYTES``; the consumer keeps an old ring as long as a batch of it is held;
- a shared ring is a torch uint8 tensor whose storage is born in shared memory, with no
  name anywhere under torch's default ``file_descriptor`` strategy (see transport.py).
"""

from __future__ import annotations

import collections
import itertools
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

__all__ = ["ARENA_BYTES", "RING_BATCHES", "RING_BYTES", "SLOTS", "Arena", "HEADER", "Space", "allocate", "place",
           "release", "reserve", "ring_bytes"]

ARENA_BYTES = 64 << 20  # the largest ring of batch buffers a reader makes, its pages reused
RING_BYTES = 4 << 20  # the smallest: a ring is sized to the batches it carries (ring_bytes)
RING_BATCHES = 4  # a ring holds this many messages of batches the size of the one it is made
# for: a worker's two prefetched ones (DataLoader's default), the one it makes, the trainer's
SLOTS = 256  # batches a ring can hold at once (one release flag each, at the ring's start)
HEADER = 8 * SLOTS
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
    done in the ring's flags (``SLOTS`` int64 at its start, :func:`release`) when no
    member of it is held any more, and the ring reuses its space from the oldest batch
    on. A batch that does not fit (the oldest still held, or larger than half the ring)
    gets a buffer of its own; a reader whose ring is full replaces it with a larger one
    (:func:`ring_bytes`), the consumer keeps the old one as long as a batch of it is held.
    """

    def __init__(self, shared: bool, size: int = ARENA_BYTES) -> None:
        self.shared = shared
        self.size = size
        self.owner, self.arr = allocate(size + HEADER, shared)
        self.flags = self.arr[:HEADER].view(np.int64)
        self.flags[:] = 0
        self.id = (os.getpid(), next(_IDS))
        self.sent = False  # the ring itself went to the consumer with its first batch
        self.live: collections.deque[tuple[int, int, int]] = collections.deque()  # (seq, start, end)
        self.head = HEADER
        self.seq = 0

    def alloc(self, nbytes: int) -> tuple[np.ndarray, int, int] | None:
        """``(view, start, seq)`` of ``nbytes`` in the ring, or None: it does not fit now."""
        live, flags, size = self.live, self.flags, self.arr.size
        while live and flags[live[0][0] % SLOTS] == live[0][0] + 1:
            live.popleft()
        n = max(1, nbytes)
        if len(live) >= SLOTS - 1 or n > (size - HEADER) // 2:
            return None
        if not live:
            self.head = start = HEADER
        else:
            tail, head = live[0][1], self.head
            if head >= tail:  # in use: [tail, head); free: after head, then before tail
                start = head if head + n <= size else (HEADER if HEADER + n <= tail else -1)
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
        release(self.flags, seq)


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


def release(flags: np.ndarray, seq: int) -> None:
    """Mark batch ``seq`` of the ring whose flags are ``flags`` done: its space may be reused."""
    flags[seq % SLOTS] = seq + 1


@dataclass
class Space:
    """Where a reader writes one batch of ``nbytes`` (:func:`reserve`): ``arr`` its writable
    bytes, ``buf`` what the message carries (the ring on its first message, else None; a
    buffer of the batch's own), ``ring`` the ring's id (None: a buffer of its own),
    ``start`` and ``seq`` its place in the ring."""

    arena: Arena
    arr: np.ndarray
    buf: Any
    ring: Any
    start: int
    seq: int

    def sent(self) -> None:
        """The batch was written and goes out: later batches of a shared ring go without it."""
        a = self.arena
        a.sent = a.sent or (a.shared and self.ring is not None)

    def drop(self) -> None:
        """The batch was not written (read on another path): its space is free now."""
        if self.ring is not None:
            self.arena.release(self.seq)


def reserve(arena: Arena | None, shared: bool, nbytes: int, run: int = 1) -> Space:
    """Space for a batch of ``nbytes`` (sent ``run`` at a time): in the reader's ring
    (:func:`place`), or in a buffer of its own when the ring cannot hold it now."""
    arena, got = place(arena, shared, nbytes, run)
    if got is None:  # the ring is full (or the batch too large for it): a buffer of its own
        buf, arr = allocate(nbytes, shared)
        return Space(arena, arr, buf, None, 0, -1)
    arr, start, seq = got
    return Space(arena, arr, None if (shared and arena.sent) else arena.owner, arena.id, start, seq)

