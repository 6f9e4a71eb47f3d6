"""Atomic local file writes: a temp file beside the target, fsync, rename, fsync the directory.

A reader sees either the old file or the whole new one; an interrupted write (crash,
SIGKILL, Ctrl-C) leaves no partial file behind, and the temp file is removed on error.

Invariants:
- a temp file is named ``<tmp_prefix><writer>.<random>.tmp`` beside its target, where
  the prefix names the target (default ``.<target basename>.``) and ``<writer>`` is
  ``<host tag>-<pid>``; it ends in ``.tmp``, so no ``*.wdsidx`` / ``*.json`` glob
  mistakes it for the target;
- the file gets the mode any new file gets: 0o666 less the process's umask (0644 under
  umask 022, 0640 under 027), whether it is new or replaces one (whose mode, a chmod
  included, is not kept): every rebuild gives the same mode;
- a writer killed outright (SIGKILL, power loss) cannot remove its temp file; the next
  successful write of the same target removes the temps of earlier writers of that
  target that are no longer running on this machine (same host tag, pid not alive). It
  never removes a temp of a live writer, one written from another machine or pid
  namespace (a shared filesystem), nor any file not named like one of ours.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import secrets
import socket
from typing import Iterable

__all__ = ["atomic_write", "stale_temps"]

_NAME_MAX = 255
_RANDOM = 8  # hex characters of the per-write random part


def _host_tag() -> str:
    """8 hex characters naming this machine and pid namespace (pids mean nothing elsewhere)."""
    try:
        namespace = str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        namespace = ""
    return hashlib.blake2b(f"{socket.gethostname()}\0{namespace}".encode(), digest_size=4).hexdigest()


def _prefix(path: str, tmp_prefix: str | None) -> str:
    """The target-specific start of the temp names of ``path``."""
    if tmp_prefix is not None:
        return tmp_prefix
    base = os.path.basename(path)
    room = _NAME_MAX - len("." + "." + "12345678-4194304." + "x" * _RANDOM + ".tmp")  # Linux pids < 2**22
    if len(base) > room:  # keep the name legal; the hash keeps it specific to this target
        digest = hashlib.blake2b(base.encode("utf-8", "surrogateescape"), digest_size=8).hexdigest()
        base = f"{base[: room - 17]}~{digest}"
    return f".{base}."


def _pattern(prefix: str) -> re.Pattern[str]:
    return re.compile(re.escape(prefix) + rf"([0-9a-f]{{8}})-([0-9]+)\.[0-9a-f]{{{_RANDOM}}}\.tmp")


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    except OSError as exc:  # pragma: no cover - EINVAL and the like: do not guess
        return exc.errno != errno.ESRCH
    return True


def stale_temps(path: str, *, tmp_prefix: str | None = None) -> list[str]:
    """Temp files beside ``path`` left by writers of ``path`` that are no longer running.

    Args:
        path: the target file.
        tmp_prefix: the prefix its writes used (default: derived from the target name).

    Returns:
        Absolute paths, sorted; empty when the directory cannot be listed.
    """
    directory = os.path.dirname(os.path.abspath(path))
    pattern, host = _pattern(_prefix(path, tmp_prefix)), _host_tag()
    stale = []
    try:
        with os.scandir(directory) as entries:
            for entry in entries:
                m = pattern.fullmatch(entry.name)
                if m and m.group(1) == host and not _alive(int(m.group(2))):
                    stale.append(os.path.join(directory, entry.name))
    except OSError:
        return []
    return sorted(stale)


def atomic_write(path: str, parts: Iterable[bytes | bytearray | memoryview], *,
                 tmp_prefix: str | None = None) -> str:
    """Write ``parts`` to ``path`` atomically; returns ``path``.

    Args:
        path: the local target file; its directory is created if missing.
        parts: the bytes to write, in order.
        tmp_prefix: how the temp file names start; it must name the target uniquely in
            its directory (the default, ``.<basename>.``, does).

    Returns:
        ``path``.
    """
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    prefix = _prefix(path, tmp_prefix)
    while True:
        tmp = os.path.join(directory, f"{prefix}{_host_tag()}-{os.getpid()}.{secrets.token_hex(_RANDOM // 2)}.tmp")
        try:
            # 0o666 less the umask, as open() makes any file (0644 under umask 022): the
            # index and state files are for other accounts to read as much as the shards
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
        except FileExistsError:  # pragma: no cover - 2**32 random names
            continue
        break
    try:
        with os.fdopen(fd, "wb") as f:
            for part in parts:
                f.write(part)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)  # make the rename itself durable
        finally:
            os.close(dir_fd)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    for stale in stale_temps(path, tmp_prefix=tmp_prefix):  # best effort: the write has succeeded
        try:
            os.unlink(stale)
        except OSError:
            pass
    return path

