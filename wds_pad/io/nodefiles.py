"""The node cache's files: one copy of each shard in a folder that a node's processes share.

A shard's file is named by the shard's identity, the URL, size and change stamp that the
index records (:func:`shard_name`): ``<digest>-<size>.shard`` once complete,
``<digest>-<size>.part`` while it is written. Who writes, and whether that writer still
lives, is the kernel's word: ``flock`` locks, which it releases when their process dies.
No process id names anything, and nothing lives in shared memory.

Invariants:
    * A ``.part`` appears already locked: its writer creates it as ``<stem>.<random>.tmp``,
      takes an exclusive ``flock`` of it, then links it to its ``.part`` name (failing if
      one exists). The writer holds the lock until it renames the file to ``.shard``
      (complete) or gives up. So a ``.part`` whose lock is free is stale: the next process
      that needs the shard takes it over and goes on from its last byte. Its bytes are a
      prefix of the shard: written in order, from GETs checked against the same size and
      stamp (which the name carries).
    * A ``.shard`` is complete: renamed from a ``.part`` whose size is the indexed size.
      A file whose size is not the one its name carries is removed, never read.
    * Readers read a ``.part`` while it grows: a range is read once the file holds its end,
      so no byte is read before it was written. A process reading a complete ``.shard``
      holds a shared lock of it; eviction removes only shards nobody holds so.
    * A writer that creates or takes over a ``.part`` checks, holding the lock, that the
      path still names the file it locked, and that no ``.shard`` exists: a file removed
      meanwhile is never written into, and a shard is never fetched twice by this protocol.
    * The folder's other files: ``.lock`` (held while the folder's bytes are counted and
      evicted) and ``<stem>.done`` (the users that finished with a shard in an epoch), both
      :mod:`wds_pad.io.noderoom`'s, which also removes files; ``<stem>.sum`` and
      ``<stem>.ok``, :mod:`wds_pad.io.nodecheck`'s. Nothing else is created, and nothing
      not named like these is removed.
    * An entry named like these that is not a regular file (a directory, a link, a
      device) is foreign: scans skip it and report it once per folder (a warning); a
      shard whose file name it takes is one :class:`ConfigError` naming it and the fix.
      A folder that cannot be written is read as it is: locks are taken only to write,
      and a write it needs is one :class:`ConfigError` naming the folder and the fix.
    * Files are created with mode 0o666 less the umask (as ``open`` does); a forked child
      closes its copies of the descriptors that hold a writer's lock, so the lock dies with
      the writer, not with the last of its children.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import fcntl
import hashlib
import os
import re
import secrets
import stat
import threading
from collections import deque
from typing import Callable

from .nodecheck import as_indexed, checksum_file, new_hash, record, write_sum
from .nodeproblems import is_regular_file, foreign, unwritable
from .stale import short_read

__all__ = ["shard_name"]

SHARD, PART, DONE = ".shard", ".part", ".done"
_FILE = re.compile(r"([0-9a-f]{32}-[0-9]+)(\.shard|\.part|\.done|\.sum|\.ok|\.[0-9a-f]{8}\.tmp)")
SIDE = (".sum", ".ok")  # a copy's checksum and the jobs that checked it (wds_pad.io.nodecheck)
MODE = 0o666  # less the umask, as open() creates files
FLAGS = getattr(os, "O_CLOEXEC", 0)

Get = Callable[[str, int, int], "concurrent.futures.Future[bytes]"]

# descriptors that hold a writer's lock in this process: a forked child closes its copies
_LOCKED: set[int] = set()
_LOCKED_GUARD = threading.Lock()


def _forget_locks() -> None:
    for fd in list(_LOCKED):
        with contextlib.suppress(OSError):
            os.close(fd)
    _LOCKED.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_locks)


def shard_name(url: str, size: int, stamp: str, content: str = "") -> str:
    """The stem of a shard's files: a digest of its URL, size, change stamp and (where the
    index records one) content identity, then its size: a shard indexed again with other
    bytes has other files."""
    key = f"{url}\0{size}\0{stamp}" + (f"\0{content}" if content else "")
    digest = hashlib.blake2b(key.encode("utf-8", "surrogateescape"), digest_size=16).hexdigest()
    return f"{digest}-{int(size)}"


def size_of(stem: str) -> int:
    """The shard size a stem carries."""
    return int(stem.rpartition("-")[2])


def parse(filename: str) -> tuple[str, str] | None:
    """(stem, suffix) of one of the cache's file names (suffix ``.tmp`` for a writer's temp
    file); None for anything else."""
    m = _FILE.fullmatch(filename)
    if m is None:
        return None
    suffix = m.group(2)
    return m.group(1), (".tmp" if suffix.endswith(".tmp") else suffix)


def path_of(folder: str, stem: str, suffix: str) -> str:
    return os.path.join(folder, stem + suffix)


def same_file(fd: int, path: str) -> bool:
    """Whether ``path`` names the file open as ``fd``."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (st.st_ino, st.st_dev) == (mine.st_ino, mine.st_dev)


def _complete(folder: str, stem: str) -> bool:
    try:
        return os.stat(path_of(folder, stem, SHARD)).st_size == size_of(stem)
    except FileNotFoundError:
        return False


def try_lock(fd: int, how: int) -> bool:
    try:
        fcntl.flock(fd, how | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _hold(fd: int) -> int:
    with _LOCKED_GUARD:
        _LOCKED.add(fd)
    return fd


def release(fd: int) -> None:
    """Gives up a writer's lock and its descriptor."""
    with _LOCKED_GUARD:
        _LOCKED.discard(fd)
    with contextlib.suppress(OSError):
        fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)


# -- reading -----------------------------------------------------------------------------
def open_copy(folder: str, stem: str) -> tuple[int, bool] | None:
    """A read-only descriptor of the shard's file: ``(fd, True)`` for the complete
    ``.shard``, ``(fd, False)`` for a ``.part`` being written (or stale); None if neither
    exists. A ``.shard`` of the wrong size is removed first."""
    for suffix in (SHARD, PART):
        path = path_of(folder, stem, suffix)
        try:
            fd = os.open(path, os.O_RDONLY | FLAGS)
        except FileNotFoundError:
            continue
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise foreign(path)
        if suffix == SHARD and os.fstat(fd).st_size != size_of(stem):
            if same_file(fd, path):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)  # not the indexed size: never read
            os.close(fd)
            continue
        return fd, suffix == SHARD
    return None


def writer_gone(fd: int) -> bool:
    """Whether nobody holds the writer's lock of the file open as ``fd`` (a ``.part``
    whose writer died or gave up, or a file that was renamed complete)."""
    if not try_lock(fd, fcntl.LOCK_SH):
        return False
    fcntl.flock(fd, fcntl.LOCK_UN)
    return True


def in_use(fd: int) -> bool:
    """Marks the complete shard open as ``fd`` as being read by this process (a shared lock,
    gone with the descriptor or the process): :func:`remove` leaves it alone. Whether it did."""
    return try_lock(fd, fcntl.LOCK_SH)


def present(folder: str, stem: str) -> bool:
    """Whether the complete shard is in the folder."""
    return _complete(folder, stem)


# -- writing -----------------------------------------------------------------------------
def claim(folder: str, stem: str) -> tuple[str, int | None]:
    """Becomes the writer of shard ``stem``: ``("mine", fd)`` with its ``.part`` locked
    (created, or a stale one taken over: its bytes kept), ``("busy", None)`` while another
    process writes it, ``("present", None)`` once it is complete."""
    part = path_of(folder, stem, PART)
    for path in (part, path_of(folder, stem, SHARD)):
        if not is_regular_file(path):
            raise foreign(path)
    while True:
        if _complete(folder, stem):
            return "present", None
        try:
            fd = os.open(part, os.O_RDWR | FLAGS)
        except FileNotFoundError:
            fd = _create(folder, stem)
            if fd is None:
                continue  # another writer linked its .part first, or a sweep took the temp file
        else:
            if not try_lock(fd, fcntl.LOCK_EX):
                os.close(fd)
                return "busy", None
        if not same_file(fd, part):  # removed, or renamed complete, after it was opened
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
            continue
        if _complete(folder, stem):  # finished by another writer before this one took the lock
            with contextlib.suppress(FileNotFoundError):
                os.unlink(part)
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
            return "present", None
        return "mine", _hold(fd)


def _create(folder: str, stem: str) -> int | None:
    """A new ``.part``, locked before it has its name; None if one was linked first."""
    tmp = path_of(folder, stem, f".{secrets.token_hex(4)}.tmp")
    try:
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | FLAGS, MODE)
    except FileExistsError:  # pragma: no cover - 2**32 random names
        return None
    except OSError as exc:
        raise unwritable(folder, exc) from None
    try:
        if not try_lock(fd, fcntl.LOCK_EX):  # a sweep probing it: it may remove it
            os.close(fd)
            return None
        try:
            os.link(tmp, path_of(folder, stem, PART))
        except FileExistsError:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
            return None
        except FileNotFoundError:  # the sweep removed the temp file before the lock
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
            return None
        return fd
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def write_rest(fd: int, url: str, size: int, get: Get, block_bytes: int, depth: int,
               kept: bool = True) -> tuple[int, str]:
    """Fetches what the locked ``.part`` lacks, in GETs of ``block_bytes`` (``depth`` in
    flight), written in order; the number of GETs, and the checksum of the whole file
    (:func:`wds_pad.io.nodecheck.checksum_file`'s, computed as the bytes arrive), or ``""``
    when the copy is not ``kept`` (:func:`complete`)."""
    have = os.fstat(fd).st_size
    if have > size:  # longer than the shard: not ours to keep
        os.ftruncate(fd, 0)
        have = 0
    h = new_hash() if kept else None
    if have and h is not None:
        checksum_file(fd, have, h)  # the prefix another writer left
    offsets = list(range(have, size, block_bytes))
    pending: deque[tuple[int, int, concurrent.futures.Future[bytes]]] = deque()
    i = 0
    try:
        while i < len(offsets) or pending:
            while i < len(offsets) and len(pending) < depth:
                off = offsets[i]
                n = min(block_bytes, size - off)
                pending.append((off, n, get(url, off, n)))
                i += 1
            off, n, fut = pending.popleft()
            data = fut.result()
            if len(data) != n:
                raise short_read(url, off, n, len(data))
            if h is not None:
                h.update(data)
            view = memoryview(data)
            while view:
                written = os.pwrite(fd, view, off)
                view, off = view[written:], off + written
    finally:
        for _, _, fut in pending:
            fut.cancel()
    return len(offsets), "" if h is None else f"blake2b={h.hexdigest()}"


def complete(folder: str, stem: str, fd: int, url: str, content: str, get: Get, block_bytes: int, depth: int,
             session: str, kept: bool = True) -> bool:
    """Completes the locked ``.part`` open as ``fd`` (:func:`write_rest`), checks it is the
    indexed shard (``content``: :func:`nodecheck.as_indexed`), keeps its checksum and
    ``session`` (the job fetched it: checked) beside it, and publishes it; whether it
    fetched anything. A failure leaves what was written for the next writer.

    ``kept=False``: a folder that goes with the job (the job's own): its copies are served
    only within ``session``, whose processes take each other's word without reading a
    ``.sum``, so none is computed or kept (blake2b costs about 1 s of CPU a GB), as a
    process's memory keeps none. A later session finds no ``.sum`` and fetches it again.
    """
    size, fetched = size_of(stem), False
    try:
        checksum = ""
        if os.fstat(fd).st_size < size:
            checksum, fetched = write_rest(fd, url, size, get, block_bytes, depth, kept)[1], True
        elif kept:
            checksum = checksum_file(fd, size)
        if kept:
            as_indexed(fd, url, checksum, content)
            write_sum(folder, stem, checksum)
        record(folder, stem, session)
    except BaseException:
        abandon(folder, stem, fd)
        raise
    publish(folder, stem, fd)
    return fetched


def publish(folder: str, stem: str, fd: int) -> None:
    """Renames the locked, complete ``.part`` to ``.shard``, then lets its lock go."""
    try:
        if os.fstat(fd).st_size == size_of(stem) and same_file(fd, path_of(folder, stem, PART)):
            os.rename(path_of(folder, stem, PART), path_of(folder, stem, SHARD))
    finally:
        release(fd)


def abandon(folder: str, stem: str, fd: int) -> None:
    """Gives up writing: an empty ``.part`` is removed, a started one kept for a later writer."""
    try:
        if os.fstat(fd).st_size == 0 and same_file(fd, path_of(folder, stem, PART)):
            os.unlink(path_of(folder, stem, PART))
    finally:
        release(fd)
