"""Room in a node's shard folder: what its bytes are counted as, what leaves it, and when.

The files themselves (names, the writer's protocol) are :mod:`wds_pad.io.nodefiles`'; this
module counts them, evicts them to make room for a fetch, removes what dead processes
left, and lets the last user of a shard remove it.

Invariants:
    * The folder's bytes are its shard files, each ``.shard`` and ``.part`` counted at the
      full size its name carries, whatever shard or index version it belongs to: a copy of
      a shard indexed again (another content or change stamp, so another name) counts
      like any other until it is removed.
    * Counting and evicting hold the folder's ``.lock`` (one process at a time decides),
      so fetches ahead stay within ``cache_bytes``: a claim counts the folder with the
      shard it adds, and removes first the files whose next planned use by the node is
      furthest; a file no plan of the node reads again (an old copy of a shard indexed
      again among them) is the furthest of all. A file is never removed for a shard needed
      later than itself, nor while a process reads it (holds :func:`nodefiles.in_use`), nor
      a ``.part`` a live writer holds.
    * A shard a read needs now is claimed even past ``cache_bytes``, and a file being read
      is not removed: the folder holds at most ``cache_bytes`` plus the shards in flight
      (being fetched or read). When a process is done with a shard, the files past the
      bound that nobody reads or writes go (:func:`trim`), furthest next use first: once
      its reads end, the folder is within ``cache_bytes``, old copies included.
    * ``<stem>.done`` lists the users that finished with a shard in an epoch; the last of
      them removes the shard with its side files.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from typing import Callable, Container, Iterator, Mapping, NamedTuple

import numpy as np

from wds_pad.errors import ConfigError

from .nodefiles import (
    DONE, FLAGS, MODE, PART, SHARD, SIDE, claim, parse, path_of, same_file, size_of, try_lock)
from .nodeproblems import is_regular_file, report_once, unwritable
from .shardplan import NodeEpoch, NodeShard

__all__ = ["FAR", "Claimed", "claim_within", "drop_unneeded", "finish", "folder_lock", "next_use", "reclaim",
           "remove", "scan", "trim"]

FAR = 1 << 62  # the next use of a shard no plan reads again


class Claimed(NamedTuple):
    """What :func:`claim_within` did: its status and locked ``.part`` (as
    :func:`nodefiles.claim`, or ``("skipped", None)``: no room for a fetch ahead), the
    folder's bytes counted with the shard, and the files it removed."""

    status: str
    fd: int | None
    used: int
    evicted: int


def next_use(epoch: NodeEpoch | None, by_name: Mapping[str, NodeShard], stem: str, now: int) -> int:
    """The step of the node's next planned read of the shard ``stem`` at or after step
    ``now`` (the next epoch's count after this one's steps; :data:`FAR`: none planned)."""
    if epoch is None:
        return FAR
    shard = by_name.get(stem)
    if shard is not None and shard.steps.size:
        i = int(np.searchsorted(shard.steps, now, side="left"))
        if i < shard.steps.size:
            return int(shard.steps[i])
    later = epoch.later.get(stem)
    return epoch.length + later if later is not None else FAR


def claim_within(folder: str, stem: str, cache_bytes: int, rank: Callable[[str], int], bar: int,
                 urgent: bool) -> Claimed:
    """Becomes the writer of shard ``stem`` if the folder has room for it within
    ``cache_bytes`` (every shard file counted at its full size), removing the files whose
    next use (``rank(stem)``) is furthest, none used at or before ``bar``; a shard a read
    needs (``urgent``) is claimed in any case."""
    evicted = 0
    with folder_lock(folder):
        files = scan(folder)
        if any(s == stem and suffix == SHARD for s, suffix, _ in files):
            return Claimed("present", None, 0, 0)
        used = sum(b for s, _, b in files if s != stem) + size_of(stem)
        if used > cache_bytes:
            ranked = sorted(((rank(s), s, suffix, b) for s, suffix, b in files if s != stem), reverse=True)
            for use, s, suffix, b in ranked:
                if used <= cache_bytes or use <= bar:
                    break
                if remove(folder, s, suffix):
                    used -= b
                    evicted += 1
        if used > cache_bytes and not urgent:
            return Claimed("skipped", None, used, evicted)
        status, fd = claim(folder, stem)
        return Claimed(status, fd, used, evicted)


def trim(folder: str, cache_bytes: int, rank: Callable[[str], int]) -> int:
    """Brings the folder back within ``cache_bytes`` once reads let go of its files:
    removes, furthest next use (``rank``) first, the shard files past the bound that no
    process reads or writes; how many. A folder within the bound is only listed; one this
    process cannot write is left as it is."""
    if sum(b for _, _, b in scan(folder)) <= cache_bytes:
        return 0
    removed = 0
    try:
        with folder_lock(folder):
            files = scan(folder)
            used = sum(b for _, _, b in files)
            for _, s, suffix, b in sorted(((rank(s), s, suffix, b) for s, suffix, b in files), reverse=True):
                if used <= cache_bytes:
                    break
                if remove(folder, s, suffix):
                    used -= b
                    removed += 1
    except ConfigError:  # a folder this process cannot write: nothing to remove
        return removed
    return removed


def drop_unneeded(folder: str, keep: str, rank: Callable[[str], int]) -> int:
    """Removes the shard files no plan of the node reads again (``rank`` :data:`FAR`),
    but ``keep``'s and those being read; how many."""
    with folder_lock(folder):
        return sum(remove(folder, s, suffix) for s, suffix, _ in scan(folder) if s != keep and rank(s) == FAR)


@contextlib.contextmanager
def folder_lock(folder: str) -> Iterator[None]:
    """Held while the folder's bytes are counted and files evicted (one process at a time)."""
    try:
        fd = os.open(os.path.join(folder, ".lock"), os.O_RDWR | os.O_CREAT | FLAGS, MODE)
    except OSError as exc:
        raise unwritable(folder, exc) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def scan(folder: str) -> list[tuple[str, str, int]]:
    """(stem, suffix, bytes it takes: its full size for a ``.part``) of each shard file."""
    out, odd = [], []
    with contextlib.suppress(FileNotFoundError):
        for name in os.listdir(folder):
            parsed = parse(name)
            if parsed is not None and parsed[1] in (SHARD, PART):
                if not is_regular_file(os.path.join(folder, name)):
                    odd.append(name)
                    continue
                out.append((parsed[0], parsed[1], size_of(parsed[0])))
    report_once(folder, odd)
    return out


def remove(folder: str, stem: str, suffix: str) -> bool:
    """Removes a complete shard that no process is reading (none holds :func:`in_use` of
    it), or a stale ``.part`` (never one a live writer holds); whether it was removed."""
    path = path_of(folder, stem, suffix)
    try:
        fd = os.open(path, os.O_RDONLY | FLAGS)
    except FileNotFoundError:
        return False
    try:
        if not try_lock(fd, fcntl.LOCK_EX) or not same_file(fd, path):
            return False
        try:
            os.unlink(path)
        except OSError:  # a folder this process cannot write
            return False
        if suffix == SHARD:
            _remove_side(folder, stem)
        return True
    finally:
        os.close(fd)


def reclaim(folder: str, known: Container[str]) -> int:
    """What dead processes left: stale ``.part`` files of shards not in ``known`` (those in
    it are kept, for the next writer to finish), temp files of dead writers, shards of the
    wrong size and ``.done`` lists of shards no longer here; the number removed."""
    removed = 0
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return 0
    stems = {p[0] for p in map(parse, names) if p is not None and p[1] in (SHARD, PART)}
    odd = []
    for name in names:
        parsed = parse(name)
        if parsed is None:
            continue
        stem, suffix = parsed
        path = os.path.join(folder, name)
        if not is_regular_file(path):
            odd.append(name)  # not ours: left alone
            continue
        if suffix == PART and stem not in known:
            removed += remove(folder, stem, PART)
        elif suffix == ".tmp":
            removed += _remove_unlocked(path)
        elif suffix == SHARD:
            with contextlib.suppress(FileNotFoundError, PermissionError, OSError):
                if os.stat(path).st_size != size_of(stem):
                    os.unlink(path)
                    removed += 1
        elif suffix in (DONE, *SIDE) and stem not in stems:
            with contextlib.suppress(OSError):  # a folder this process cannot write: left as it is
                os.unlink(path)
                removed += 1
    report_once(folder, odd)
    return removed


def _remove_side(folder: str, stem: str) -> None:
    for suffix in SIDE:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path_of(folder, stem, suffix))


def _remove_unlocked(path: str) -> int:
    try:
        fd = os.open(path, os.O_RDONLY | FLAGS)
    except FileNotFoundError:
        return 0
    try:
        if not try_lock(fd, fcntl.LOCK_EX):
            return 0
        with contextlib.suppress(OSError):
            os.unlink(path)
            return 1
        return 0
    finally:
        os.close(fd)


def finish(folder: str, stem: str, epoch: int, user: int, users: Container[int] | frozenset[int]) -> bool:
    """User ``user`` has made its last planned read of the shard in ``epoch``; the last of
    ``users`` removes the shard (which nobody plans to read again). True if it did."""
    done = path_of(folder, stem, DONE)
    try:
        fd = os.open(done, os.O_WRONLY | os.O_APPEND | os.O_CREAT | FLAGS, MODE)
    except OSError:
        return False  # a folder this process cannot write: its copies stay
    try:
        os.write(fd, f"{epoch} {user}\n".encode())  # one small append: whole or not at all
    finally:
        os.close(fd)
    try:
        with open(done, encoding="ascii", errors="replace") as f:
            lines = f.read().split("\n")
    except FileNotFoundError:
        return False
    finished = set()
    for line in lines:
        e, _, u = line.partition(" ")
        if e == str(epoch) and u.isdigit():
            finished.add(int(u))
    if not all(u in finished for u in users):  # type: ignore[union-attr]
        return False
    for suffix in (SHARD, DONE, *SIDE):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path_of(folder, stem, suffix))
    return True
