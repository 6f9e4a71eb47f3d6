"""Is a node's copy of a shard the bytes the index describes: checked once per job.

A copy in the node's folder (:mod:`wds_pad.io.nodefiles`) outlives the job that fetched it;
the store may have changed since, and the disk may have damaged it. Before a job serves a
copy it did not fetch itself, it asks the store and the file, once per job on the node.

Invariants:
    * A copy is published with its checksum beside it: ``<stem>.sum`` holds
      ``"blake2b=<hex>"`` of its bytes, computed while they were fetched (a taken-over
      ``.part``'s prefix read back first), written before the ``.part`` is renamed
      ``.shard``. A ``.shard`` without a readable ``.sum`` is never served to another job.
      The job's own folder, which goes with the job, keeps none (``kept=False``,
      :func:`wds_pad.io.nodefiles.complete`): its copies are served within the session only.
    * The first process of a job that opens a copy the job did not fetch checks it: the
      store's identity of the shard (one HEAD or stat, the caller's ``store_check``)
      against the index, then the file's checksum against its ``.sum`` (one read of the
      file). It does so holding an exclusive ``flock`` of ``<stem>.ok``, then adds the
      job's session there, so the node's other processes of the job take its word: at
      most one HEAD per shard per node per job. A job that fetched a copy records its
      session before publishing it.
    * A copy whose checksum differs (or has none: then without asking the store) is
      removed with its side files, and is fetched again; a shard the store changed
      raises what ``store_check`` raises (:class:`StaleShardError`, the text a read
      without a cache gives).
    * In a folder the process cannot write, each process checks the copies it opens
      itself (nothing can be recorded), and a damaged copy there is one
      :class:`ConfigError` naming the folder and the fix.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import secrets
import threading
from typing import Callable

from wds_pad.errors import ConfigError, StaleShardError

from .redact import redact

__all__ = ["OK", "SUM", "Checks", "as_indexed", "checksum_file", "new_hash", "record", "verify", "write_sum"]

SUM, OK = ".sum", ".ok"
_FLAGS = getattr(os, "O_CLOEXEC", 0)
_MODE = 0o666
_CHUNK = 8 * 2**20
_SESSIONS = 8  # sessions kept in a .ok file (jobs sharing the folder take turns)


def new_hash() -> "hashlib._Hash":
    """The hash a copy's checksum is made with (also an index's content identity)."""
    return hashlib.blake2b(digest_size=16)


def checksum_file(fd: int, size: int, h: "hashlib._Hash | None" = None) -> str:
    """``"blake2b=<hex>"`` of the first ``size`` bytes of the file open as ``fd``."""
    h = new_hash() if h is None else h
    off = 0
    while off < size:
        data = os.pread(fd, min(_CHUNK, size - off), off)
        if not data:
            break
        h.update(data)
        off += len(data)
    return f"blake2b={h.hexdigest()}"


def as_indexed(fd: int, url: str, checksum: str, content: str) -> None:
    """Raises :class:`StaleShardError` if a fetched copy's checksum is not the index's
    content identity of the shard (``""``: none recorded); the ``.part`` is emptied first,
    so nobody reads the store's other bytes."""
    if content and checksum != content:
        os.ftruncate(fd, 0)
        raise StaleShardError(
            f"shard {redact(url)!r} changed since it was indexed: its bytes are not the ones the index records "
            f"({content}), although its size and change stamp are; re-index it: `wds-pad index SHARDS -o INDEX "
            "--update --rescan URL` (or restore the shard)")


def _path(folder: str, stem: str, suffix: str) -> str:
    return os.path.join(folder, stem + suffix)


def write_sum(folder: str, stem: str, checksum: str) -> None:
    """Writes ``<stem>.sum`` atomically (temp file in the folder, renamed)."""
    tmp = _path(folder, stem, f".{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _FLAGS, _MODE)
    try:
        os.write(fd, checksum.encode("ascii"))
    finally:
        os.close(fd)
    try:
        os.rename(tmp, _path(folder, stem, SUM))
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def read_sum(folder: str, stem: str) -> str | None:
    """The checksum beside a copy, or None (none, or unreadable)."""
    try:
        with open(_path(folder, stem, SUM), encoding="ascii", errors="replace") as f:
            text = f.read(200).strip()
    except OSError:
        return None
    return text if text.startswith("blake2b=") else None


def record(folder: str, stem: str, session: str) -> None:
    """Adds ``session`` to the copy's ``.ok`` (a job that fetched the copy, or checked it)."""
    with contextlib.suppress(OSError):
        fd = os.open(_path(folder, stem, OK), os.O_RDWR | os.O_CREAT | _FLAGS, _MODE)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            _add(fd, session)
        finally:
            os.close(fd)


def _sessions(fd: int) -> list[str]:
    data = os.pread(fd, 1 << 16, 0).decode("utf-8", "replace")
    return [line for line in data.split("\n") if line]


def _add(fd: int, session: str) -> None:
    kept = [s for s in _sessions(fd) if s != session][-(_SESSIONS - 1):] + [session]
    data = ("\n".join(kept) + "\n").encode("utf-8", "replace")
    os.pwrite(fd, data, 0)
    os.ftruncate(fd, len(data))


def remove_copy(folder: str, stem: str, fd: int) -> None:
    """Removes the copy open as ``fd`` (if its path still names it) and its side files."""
    path = _path(folder, stem, ".shard")
    try:
        st, mine = os.stat(path), os.fstat(fd)
    except OSError:
        return
    if (st.st_ino, st.st_dev) != (mine.st_ino, mine.st_dev):
        return
    for suffix in (".shard", SUM, OK):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(_path(folder, stem, suffix))


def verify(folder: str, stem: str, fd: int, size: int, session: str,
           store_check: Callable[[], None] | None) -> bool:
    """Checks the complete copy open as ``fd`` once per job (see the module invariants).

    Returns:
        True: serve it; False: it was damaged (or had no checksum) and is removed.

    Raises:
        StaleShardError: (from ``store_check``) the store's shard is not the indexed one.
        ConfigError: a damaged copy in a folder this process cannot write.
    """
    lock: int | None
    try:
        lock = os.open(_path(folder, stem, OK), os.O_RDWR | os.O_CREAT | _FLAGS, _MODE)
    except OSError:
        lock = None  # a folder this process cannot write: its own check, nothing recorded
    try:
        if lock is not None:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if session and session in _sessions(lock):
                return True
        want = read_sum(folder, stem)
        if want is not None and store_check is not None:  # none: fetched again, through checked GETs
            store_check()
        if want is not None and checksum_file(fd, size) == want:
            if lock is not None and session:
                _add(lock, session)
            return True
        if lock is None:
            raise ConfigError(
                f"the node's copy {_path(folder, stem, '.shard')!r} is damaged (its checksum differs from "
                f"the one kept when it was fetched) and the folder {folder!r} cannot be written, so it cannot "
                "be fetched again; remove the file, or make the folder writable, or pass another "
                "ReadOptions(cache_dir=...)")
        remove_copy(folder, stem, fd)
        return False
    finally:
        if lock is not None:
            os.close(lock)


class Checks:
    """The copies one process serves, each checked once (:func:`verify`), or fetched by it.

    Args:
        folder: the node's folder.
        store_check: ``store_check(url)`` asks the store whether the shard is the indexed
            one (raising :class:`StaleShardError` if not); None: no such check.
        session: this job on this node.
    """

    def __init__(self, folder: str, store_check: Callable[[str], None] | None, session: str) -> None:
        self.folder, self.store_check, self.session = folder, store_check, session
        self._valid: set[str] = set()  # stems whose copy this process checked or fetched
        self._lock = threading.Lock()
        self.damaged = 0  # copies found damaged (removed, fetched again)

    def ok(self, url: str, stem: str, size: int, fd: int) -> bool:
        """Whether the complete copy open as ``fd`` may be served; False if it was damaged
        (and is removed)."""
        if stem in self._valid:
            return True
        with self._lock:
            if stem in self._valid:
                return True
            check = None if self.store_check is None else (lambda: self.store_check(url))  # type: ignore[misc]
            if verify(self.folder, stem, fd, size, self.session, check):
                self._valid.add(stem)
                return True
            self.damaged += 1
            return False

    def fetched(self, stem: str) -> None:
        """This process published the copy: it is served without a check."""
        with self._lock:
            self._valid.add(stem)
