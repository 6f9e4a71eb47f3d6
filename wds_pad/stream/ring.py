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
  name anywhere under torch's default ``file_descriptor`` strategy (see transport.py);
- shared memory is bounded (``/dev/shm``: 64 MiB in a container by default): a reader's
  ring takes at most half the free space divided among the DataLoader's workers
  (:func:`ring_cap`), and a batch for which no shared memory can be had gets a buffer of
  its own in the worker's memory, pickled through the pipe (a copy more), with a note
  saying why (:attr:`Space.short`, warned in the main process once an iteration); the
  worker tries shared memory again ``AVOID_BATCHES`` batches later.
"""

from __future__ import annotations

import collections
import errno
import itertools
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import get_worker_info

from ..errors import WorkerStartError

__all__ = ["ARENA_BYTES", "AVOID_BATCHES", "RING_BATCHES", "RING_BYTES", "SHM", "SLOTS", "Arena", "HEADER",
           "NoSharedMemory", "Space", "allocate", "place", "release", "reserve", "ring_bytes", "ring_cap",
           "shared_ints"]

ARENA_BYTES = 64 << 20  # the largest ring of batch buffers a reader makes, its pages reused
RING_BYTES = 4 << 20  # the smallest: a ring is sized to the batches it carries (ring_bytes)
RING_BATCHES = 4  # a ring holds this many messages of batches the size of the one it is made
# for: a worker's two prefetched ones (DataLoader's default), the one it makes, the trainer's
SLOTS = 256  # batches a ring can hold at once (one release flag each, at the ring's start)
HEADER = 8 * SLOTS
SHM = "/dev/shm"  # where shared memory lives (torch's segments): its free space bounds the rings
AVOID_BATCHES = 64  # after shared memory ran out, batches a reader sends through the pipe before trying again
_IDS = itertools.count()
_AVOID = [0, ""]  # batches left to send without shared memory in this process, and why


def _fresh() -> None:  # a forked reader starts with shared memory worth trying
    _AVOID[:] = [0, ""]


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_fresh)


class NoSharedMemory(Exception):
    """No shared memory could be had for a buffer (``/dev/shm`` full or too small)."""


def _short_of_memory(exc: BaseException) -> bool:
    """Whether torch's shared allocation failed for want of room (``ENOSPC``, ``ENOMEM``),
    not for another reason (no descriptor left, say: that error propagates)."""
    text = str(exc)
    return (getattr(exc, "errno", None) in (errno.ENOSPC, errno.ENOMEM) or "No space left on device" in text
            or "Cannot allocate memory" in text)


def shm_room(path: str = SHM) -> tuple[int, int] | None:
    """(size, free bytes) of the shared memory filesystem, or None where there is none."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize


def ring_cap(shared: bool) -> int:
    """The largest ring this reader makes: ``ARENA_BYTES``, and for a shared one at most
    half the free shared memory divided among the DataLoader's workers (the other half
    for batches of their own and the rest of the machine)."""
    if not shared:
        return ARENA_BYTES
    room = shm_room()
    if room is None:
        return ARENA_BYTES
    info = get_worker_info()
    workers = 1 if info is None else max(1, info.num_workers)
    return max(0, min(ARENA_BYTES, room[1] // (2 * workers)))


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
        try:
            storage = torch.UntypedStorage._new_shared(size)
            tensor = torch.empty(0, dtype=torch.uint8).set_(storage)  # type: ignore[call-overload]
        except (AttributeError, TypeError):  # another torch: shared after the fact
            tensor = torch.empty(size, dtype=torch.uint8).share_memory_()
    except (RuntimeError, OSError) as exc:
        if _short_of_memory(exc):
            raise NoSharedMemory(str(exc)) from exc
        raise
    tensor = tensor[:nbytes]
    return tensor, tensor.numpy()


def shared_ints(values: list[int], owner: str) -> torch.Tensor:
    """A small int64 tensor in shared memory (a loader's flags for its workers).

    Raises:
        WorkerStartError: no shared memory is left for it, naming the filesystem and the fix.
    """
    try:
        return torch.tensor(values, dtype=torch.int64).share_memory_()
    except (RuntimeError, OSError) as exc:
        if not _short_of_memory(exc):
            raise
        raise WorkerStartError(
            f"{owner}: its DataLoader workers cannot start: no shared memory is left ({exc}; {_room_said()}). Free "
            f"some (files left in {SHM} by other programs), give it more room (docker run --shm-size=2g), or "
            "iterate with num_workers=0") from exc


def ring_bytes(nbytes: int, size: int = 0, run: int = 1, cap: int = ARENA_BYTES) -> int:
    """The size of a ring for batches of about ``nbytes`` sent ``run`` at a time, or of the
    ring that replaces a full one of ``size``: room for ``RING_BATCHES`` runs of them, twice
    the full one, between ``RING_BYTES`` and ``cap`` (``ARENA_BYTES``, or less where shared
    memory is short: :func:`ring_cap`). Every page of a ring is touched once (a page fault
    in the worker and in the main process), so it is no larger than what is in flight: a
    worker's prefetched batches and the ones the trainer holds."""
    return min(cap, ARENA_BYTES, max(RING_BYTES, RING_BATCHES * max(1, run) * nbytes, 2 * size))


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
          run: int = 1) -> tuple[Arena | None, tuple[np.ndarray, int, int] | None]:
    """Where a reader puts a batch of ``nbytes`` (sent ``run`` at a time): its ring (made now
    for this process if ``arena`` is None or another process's; a larger one if it is full)
    and the batch's place there (:meth:`Arena.alloc`), or None: a buffer of its own (also
    when the free shared memory holds no ring for it: :func:`ring_cap`).

    Raises:
        NoSharedMemory: a shared ring could not be made.
    """
    if arena is None or arena.id[0] != os.getpid():
        cap = ring_cap(shared)
        if cap < HEADER + 2 * max(1, nbytes):  # no ring of room for two such batches
            return None, None
        arena = Arena(shared, ring_bytes(nbytes, run=run, cap=cap))
    got = arena.alloc(nbytes)
    if got is None and arena.size < ARENA_BYTES and 2 * nbytes <= ARENA_BYTES:
        cap = ring_cap(shared) + arena.size + HEADER  # the full ring is given back once its batches are
        if ring_bytes(nbytes, arena.size, cap=cap) > arena.size:
            arena = Arena(shared, ring_bytes(nbytes, arena.size, cap=cap))
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

    arena: Arena | None
    arr: np.ndarray
    buf: Any
    ring: Any
    start: int
    seq: int
    short: str | None = None  # why the batch is not in shared memory though it was asked to be

    def sent(self) -> None:
        """The batch was written and goes out: later batches of a shared ring go without it."""
        a = self.arena
        if a is not None:
            a.sent = a.sent or (a.shared and self.ring is not None)

    def drop(self) -> None:
        """The batch was not written (read on another path): its space is free now."""
        if self.ring is not None and self.arena is not None:
            self.arena.release(self.seq)


def reserve(arena: Arena | None, shared: bool, nbytes: int, run: int = 1) -> Space:
    """Space for a batch of ``nbytes`` (sent ``run`` at a time): in the reader's ring
    (:func:`place`), or in a buffer of its own when the ring cannot hold it now; where
    no shared memory can be had, in this process's memory, with the reason in ``short``."""
    if shared and _AVOID[0] > 0:  # shared memory ran out lately: not tried again yet
        _AVOID[0] -= 1
        return _unshared(arena, nbytes, _AVOID[1])
    try:
        arena, got = place(arena, shared, nbytes, run)
        if got is None:  # the ring is full (or the batch too large for it): a buffer of its own
            buf, arr = allocate(nbytes, shared)
            return Space(arena, arr, buf, None, 0, -1)
    except NoSharedMemory as exc:
        _AVOID[:] = [AVOID_BATCHES, _why(nbytes, exc)]
        return _unshared(arena, nbytes, _AVOID[1])
    arr, start, seq = got
    assert arena is not None
    return Space(arena, arr, None if (shared and arena.sent) else arena.owner, arena.id, start, seq)


def _unshared(arena: Arena | None, nbytes: int, why: str) -> Space:
    """A batch's buffer in this process's memory: pickled through the pipe with its batch."""
    _, arr = allocate(nbytes, False)
    return Space(arena if arena is not None and arena.id[0] == os.getpid() else None, arr, arr, None, 0, -1, why)


def _why(nbytes: int, exc: BaseException) -> str:
    size = f"{nbytes / 2**20:.1f} MiB" if nbytes >= 2**20 // 10 else f"{max(1, -(-nbytes // 1024))} KiB"
    return f"a DataLoader worker could not get {size} of shared memory for a batch ({exc}); {_room_said()}"


def _room_said() -> str:
    """How large the shared memory filesystem is and what of it is free, for a message."""
    room = shm_room()
    if room is None:
        return "no shared memory filesystem was found to measure"
    return f"{SHM} holds {room[0] / 2**20:.0f} MiB, {room[1] / 2**20:.0f} MiB of it free"

