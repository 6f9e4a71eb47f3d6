"""Disk mode of the shard cache: one file per shard in a folder the DataLoader workers of
a rank share, fetched once under a lock and deleted by its last planned user.

Invariants:
    * A shard is one file ``<owner>-<digest>.shard`` (the digest of the plan's key and
      the URL), written as ``.<pid>.part`` under an exclusive ``flock`` of
      ``<owner>-<digest>.lock`` and renamed into place when complete: a reader never sees a
      partial file, and the workers of a rank fetch it once.
    * Each user appends its worker id to ``<owner>-<digest>.done`` after its last range,
      under the same lock; the last of the planned users deletes the shard's files.
    * A file is open only inside the call that needs it (a shard being fetched holds its
      lock and its part); running out of descriptors is the limit's error
      (:func:`~wds_pad.io.descriptors.out_of_descriptors`), not the shard's.
    * Files are named by their owner's pid, so what a crashed run left behind is known by
      its dead owner and removed (:func:`sweep_dead_owners`); files of live owners, and
      anything not named by the cache, are left alone.
"""

from __future__ import annotations

import concurrent.futures
import fcntl
import hashlib
import os
from typing import IO, Any, Callable

from .atomic import _alive
from .descriptors import out_of_descriptors, runs_out

__all__ = ["sweep_dead_owners"]


def shard_file(folder: str, owner: int, key: str, url: str) -> str:
    """The path (without suffix) of the files of shard ``url`` planned under ``key``."""
    name = hashlib.sha256(f"{key}\0{url}".encode()).hexdigest()[:32]
    return os.path.join(folder, f"{owner}-{name}")


def _open(path: str, mode: str) -> IO[Any]:
    try:
        return open(path, mode)
    except OSError as exc:
        if runs_out(exc):
            raise out_of_descriptors(f"cannot open the shard cache's file {path!r}", exc,
                                     fewer="DataLoader workers") from exc
        raise


def fetch_to_file(path: str, url: str, size: int, block_bytes: int,
                  get: Callable[[str, int, int], concurrent.futures.Future[bytes]]) -> bool:
    """Makes ``path.shard`` the whole shard, fetched in blocks unless another worker of the
    rank has; True if this call fetched it."""
    data = path + ".shard"
    with _open(path + ".lock", "a+b") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if os.path.exists(data) and os.path.getsize(data) == size:
                return False  # another worker of the rank fetched it
            blocks = [get(url, off, min(block_bytes, size - off))
                      for off in range(0, size, block_bytes)]
            part = f"{data}.{os.getpid()}.part"
            with _open(part, "wb") as f:
                for b in blocks:
                    f.write(b.result())
            os.replace(part, data)
            return True
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def read_file(path: str, start: int, length: int) -> bytes:
    """The bytes ``[start, start + length)`` of the complete shard file at ``path``."""
    with _open(path + ".shard", "rb") as f:
        return os.pread(f.fileno(), length, start)


def finish(path: str, worker: int, users: frozenset[int]) -> None:
    """Worker ``worker`` is done with the shard; the last of ``users`` deletes its files."""
    with _open(path + ".lock", "a+b") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            with _open(path + ".done", "a") as f:
                f.write(f"{worker}\n")
            with _open(path + ".done", "r") as f:
                done = {int(x) for x in f.read().split()}
            if users <= done:
                for suffix in (".shard", ".done", ".lock"):
                    try:
                        os.unlink(path + suffix)
                    except FileNotFoundError:
                        pass
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def sweep_dead_owners(folder: str) -> int:
    """Removes the shard files in ``folder`` whose owner process is gone (a run that crashed
    or was killed before its last planned reads deleted them), and partial downloads
    (``.<pid>.part``) of dead writers; the number of files removed. Files of live owners,
    and anything not named by this cache, are left alone."""
    removed = 0
    try:
        names = os.listdir(folder)
    except OSError:
        return 0
    for name in names:
        stem, _, suffix = name.rpartition(".")
        if suffix == "part":
            pid = stem.rpartition(".")[2]
        elif suffix in ("shard", "lock", "done"):
            pid = stem.partition("-")[0]
        else:
            continue
        if not pid.isdigit() or _alive(int(pid)):
            continue
        try:
            os.unlink(os.path.join(folder, name))
            removed += 1
        except OSError:
            pass
    return removed
