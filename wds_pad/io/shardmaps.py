"""Local shards mapped into memory, for a process that reads them again: no system call a sample.

Reading a 10 KB sample from the page cache with ``os.pread`` costs a system call beside
the copy; copying it out of a mapping of the shard costs the copy alone, once the
mapping's pages are in the process's page tables. Making those entries costs about what
the system calls save in one pass, so a mapping pays from the second pass on: the batch
path (stream/batchread.py) reads a shard with ``os.pread`` the first time this process
streams it, and copies samples out of a mapping kept here for every later stream (the
next epochs of a one-process loop, or of the trainer's own process).

Invariants:
- a mapping is read-only and shared (``MAP_SHARED``): it shows what ``os.pread`` of the
  same file shows, the page cache's bytes, changed in place or not; every member handed
  out is a copy (``bytes``, or a view of the batch's own buffer), never a view of a mapping;
- a mapping belongs to one file (device and inode): a reader asks for it with the
  descriptor it opened, and checked against the index, for its stream, and gets the kept
  mapping only if that descriptor's file is the one mapped, with the same size and
  modification time; else the file is mapped again;
- a process maps no shard on its first stream over it (:func:`mapped` answers None and
  remembers the path), and a forked child (a DataLoader worker, which lives one epoch)
  starts remembering nothing; the main process of a ``Loader`` maps a shard the first
  time a kept worker sends it a batch of it by reference (``at_once``, its pages were
  just read: stream/mappedbatch.py);
- a batch copy that waited for the disk (a major page fault: the shard was not in the
  page cache) turns mapping off for the process (:func:`stop`) for ``RETRY_SECONDS``:
  ``os.pread`` reads an uncached sample in one request, a mapping page by page. Then it
  is tried again: a page cache trimmed once (another job, the host reclaiming memory)
  costs one minute of ``os.pread``, not the rest of the job, and shards that do not fit
  in it cost one batch of page-by-page reads a minute;
- at most ``MAX_MAPS`` mappings of at most ``MAX_MAP_BYTES`` in all are kept (bounding the
  page tables), and no more than the descriptor budget (``io.descriptors.fd_budget``: a
  mapping holds a descriptor of its own, Python's ``mmap`` duplicates the file's), the
  least recently asked for dropped first; its memory is unmapped, and its descriptor
  closed, when the last copy out of it ends;
- touching a mapped page past the end of a file cut short after it was mapped kills the
  process (``SIGBUS``), so a reader compares each shard's size with its mapping's before
  every batch it copies (:func:`shrunk`) and reads a shorter one with ``os.pread``, which
  says what changed. A file cut short between that check and the copy (microseconds) is
  the one case not turned into an error; a shard replaced by a rename (how shards are
  usually rewritten) is safe: the mapping keeps the old file;
- a file that cannot be mapped (empty, a pipe, a filesystem without ``mmap``) is read
  with ``os.pread``: :func:`mapped` answers None; ``ReadOptions(map_local=False)`` maps none.
"""

from __future__ import annotations

import mmap
import os
import resource
import threading
import time
from collections import OrderedDict
from typing import Any

from .descriptors import fd_budget

__all__ = ["MAX_MAPS", "MAX_MAP_BYTES", "faults", "mapped", "shrunk", "stop", "stopped", "waited"]

MAX_MAPS = 4096  # well below the kernel's vm.max_map_count (65530 by default)
MAX_MAP_BYTES = 64 << 30  # page tables of at most 0.2 % of it (8 bytes a 4 KiB page)

#: path -> (the file's identity when mapped, a read-only memoryview of its mapping)
_MAPS: OrderedDict[str, tuple[tuple[int, int, int, int], memoryview]] = OrderedDict()
_SEEN: set[str] = set()  # paths this process streamed once (with os.pread)
_STOPPED: list[tuple[str, float]] = []  # why this process maps no more, and since when (time.monotonic)
RETRY_SECONDS = 60.0  # mapping is tried again this long after a copy waited for the disk
_LOCK = threading.Lock()


def mapped(path: str, fd: int, at_once: bool = False) -> memoryview | None:
    """A read-only view of the whole file ``fd`` (opened on ``path``) to copy samples out
    of: the kept mapping if it is of this file as it is now, else a new one, kept; None:
    the first stream of ``path`` in this process (unless ``at_once``: another process
    just read it, stream/mappedbatch.py), mapping stopped (:func:`stop`), or a file that
    cannot be mapped."""
    with _LOCK:
        if _stopped() is not None:
            return None
        if not at_once and path not in _SEEN:
            _SEEN.add(path)
            return None
    try:
        st = os.fstat(fd)
    except OSError:
        return None
    ident = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    with _LOCK:
        kept = _MAPS.get(path)
        if kept is not None and kept[0] == ident:
            _MAPS.move_to_end(path)
            return kept[1]
    if not st.st_size:
        return None
    try:
        view = memoryview(mmap.mmap(fd, 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ))
    except (OSError, ValueError):
        return None
    with _LOCK:
        _MAPS[path] = (ident, view)
        _MAPS.move_to_end(path)
        total = sum(len(v) for _, v in _MAPS.values())
        most = min(MAX_MAPS, fd_budget())
        while len(_MAPS) > 1 and (len(_MAPS) > most or total > MAX_MAP_BYTES):
            total -= len(_MAPS.popitem(last=False)[1][1])
    return view


def shrunk(fds: dict[str, int], maps: dict[str, Any], urls: set[str]) -> bool:
    """Whether any shard of ``urls`` is now shorter than its mapping in ``maps`` (or lost
    its descriptor in ``fds``): one ``lseek`` to its end each (a third of an ``fstat``'s
    cost; every read of a descriptor here is positional, so its offset is nobody's)."""
    seek, end = os.lseek, os.SEEK_END
    try:
        for url in urls:
            if seek(fds[url], 0, end) < len(maps[url]):
                return True
    except (KeyError, OSError):
        return True
    return False


_WHO = getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)  # the thread's own where the system counts it


def faults() -> int:
    """Major page faults of the calling thread so far (of the process where the system
    counts no thread's own): reads that waited for the disk."""
    return resource.getrusage(_WHO).ru_majflt


def waited(since: int) -> None:
    """After a batch copied out of mappings: if it waited for the disk (the thread's major
    page faults are no longer ``since``, :func:`faults` before the copy), map no more."""
    if faults() != since:
        stop("a batch copied out of mapped shards waited for the disk (they are not in the page cache)")


def stop(why: str) -> None:
    """Map no more shards in this process for ``RETRY_SECONDS`` (kept mappings are dropped): ``why``."""
    with _LOCK:
        _STOPPED[:] = [(why, time.monotonic())]
        _MAPS.clear()


def stopped() -> str | None:
    """Why this process maps no shards now, or None (never stopped, or ``RETRY_SECONDS``
    have passed since: mapping is on again, and a copy that waits stops it again)."""
    with _LOCK:
        return _stopped()


def _stopped() -> str | None:  # under _LOCK
    if _STOPPED and time.monotonic() - _STOPPED[0][1] >= RETRY_SECONDS:
        _STOPPED.clear()  # the page cache may hold the shards again (it was trimmed, or they fit)
    return _STOPPED[0][0] if _STOPPED else None


def _forget() -> None:  # in a forked child: nothing seen, nothing kept, mapping on again
    global _LOCK
    _LOCK = threading.Lock()
    _MAPS.clear()
    _SEEN.clear()
    _STOPPED.clear()


os.register_at_fork(after_in_child=_forget)
