"""Atomic local file writes: a temp file beside the target, fsync, rename, fsync the directory.

A reader sees either the old file or the whole new one; an interrupted write (crash,
SIGKILL, Ctrl-C) leaves no partial file behind, and the temp file is removed on error.
"""

from __future__ import annotations

import os
import tempfile
from typing import Iterable


def atomic_write(path: str, parts: Iterable[bytes | bytearray | memoryview], *, tmp_prefix: str = ".tmp-") -> str:
    """Write ``parts`` to ``path`` atomically; returns ``path``."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=tmp_prefix, suffix=".tmp", dir=directory)
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
    return path
