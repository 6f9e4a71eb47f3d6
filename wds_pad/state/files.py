"""Per-rank state files: atomic, the rank in the name, a checksum over the content.

Invariants:
- a file is written atomically (temp file + fsync + rename), one per rank, the rank in
  the file name, with a checksum over the state and ``saved_by_rank``;
- loading rank r's file on another rank is refused; an edited, truncated or corrupt
  file is a StateError; a wrong kind of path is a StateError naming it.
"""

from __future__ import annotations

import errno
import json
import os
from typing import Any, Mapping

from ..core.seed import json_digest
from ..errors import StateError, TopologyMismatchError
from ..io.atomic import atomic_write
from .schema import STATE_FILE_FORMAT, is_count, check_schema

__all__ = ["load_state_file", "save_state_file", "state_path"]


def state_path(directory: str, rank: int, prefix: str = "loader") -> str:
    """``DIRECTORY/<prefix>-rank00005.json``: one file per rank, the rank in the name."""
    return os.path.join(directory, f"{prefix}-rank{rank:05d}.json")


def _checksum(state: Mapping[str, Any], saved_by_rank: Any = None) -> str:
    return json_digest({"saved_by_rank": saved_by_rank, "state": state})


def _check_rank(rank: Any, what: str) -> int:
    if not is_count(rank):
        raise StateError(f"{what} must be an int >= 0 (a rank), got {type(rank).__name__} {rank!r}")
    return int(rank)


def save_state_file(state: Mapping[str, Any], directory: str, rank: int, prefix: str = "loader") -> str:
    """Write ``state`` atomically (temp file, fsync, rename) to this rank's file.

    Args:
        state: a JSON-safe state, e.g. ``loader.state_dict()``.
        directory: the checkpoint directory (created if missing).
        rank: this process's rank (part of the file name and checked on load).
        prefix: file name prefix.

    Returns:
        The path written.

    Raises:
        StateError: ``state`` is not JSON-safe, ``rank`` is not a rank, ``directory`` is a
            file (or under one), or this rank's file name is taken by a directory; nothing
            already saved is changed.
    """
    rank = _check_rank(rank, "save_state_file: rank")
    if not isinstance(directory, (str, os.PathLike)) or not str(directory):
        raise StateError(f"save_state_file: directory must be a non-empty path, got {directory!r}")
    directory = os.fspath(directory)
    path = state_path(directory, rank, prefix)
    try:
        data = json.dumps({"format": STATE_FILE_FORMAT, "saved_by_rank": rank,
                           "checksum": _checksum(dict(state), rank), "state": dict(state)},
                          sort_keys=True, allow_nan=False).encode()
    except (TypeError, ValueError) as exc:
        raise StateError(f"state for {path!r} is not JSON-safe: {exc}") from exc
    if os.path.isdir(path):
        raise StateError(f"cannot save the loader state to {path!r}: a directory has that name; "
                         "remove it or save into another checkpoint directory")
    try:
        os.makedirs(directory, exist_ok=True)
        atomic_write(path, [data], tmp_prefix=f".{prefix}-rank{rank:05d}.")
    except (FileExistsError, NotADirectoryError) as exc:
        raise StateError(f"cannot save the loader state into {directory!r}: it (or a parent) is a file, "
                         "not a directory; choose another checkpoint directory") from exc
    except IsADirectoryError as exc:
        raise StateError(f"cannot save the loader state to {path!r}: a directory has that name; "
                         "remove it or save into another checkpoint directory") from exc
    except OSError as exc:
        if exc.errno in (errno.ENOTDIR, errno.EEXIST):
            raise StateError(f"cannot save the loader state into {directory!r}: a parent is a file, not "
                             "a directory; choose another checkpoint directory") from exc
        raise StateError(f"cannot save the loader state to {path!r}: {exc.strerror or exc}; check the "
                         "checkpoint directory (permissions, free space)") from exc
    return path


def load_state_file(path: str, rank: int, prefix: str = "loader") -> dict[str, Any]:
    """Read the state :func:`save_state_file` wrote for ``rank``.

    Symmetric with :func:`save_state_file`: ``path`` is the checkpoint directory (this
    rank's file in it is read, ``state_path(path, rank, prefix)``), or the file itself.

    Args:
        path: the checkpoint directory, or one rank's state file.
        rank: this process's rank (checked against the rank that saved the file).
        prefix: file name prefix, as given to save_state_file.

    Raises:
        StateError: missing, unreadable, truncated or corrupt file, or a checksum that
            does not cover the content (edited).
        TopologyMismatchError: the file was saved by another rank.
    """
    rank = _check_rank(rank, "load_state_file: rank")
    if os.path.isdir(path):
        path = state_path(os.fspath(path), rank, prefix)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise StateError(f"state file {path!r} does not exist; check the checkpoint directory "
                         "or start afresh") from None
    except IsADirectoryError:
        raise StateError(f"state file {path!r} is a directory; pass the checkpoint directory or "
                         "this rank's file in it") from None
    except OSError as exc:
        raise StateError(f"state file {path!r} cannot be read ({exc.strerror or exc}); check the path "
                         "and its permissions") from exc
    try:
        doc = json.loads(raw)
    except ValueError as exc:
        raise StateError(f"state file {path!r} is corrupt or truncated ({len(raw)} bytes: {exc}); "
                         "resume from an earlier checkpoint") from exc
    if not isinstance(doc, dict) or not isinstance(doc.get("state"), dict) or "saved_by_rank" not in doc:
        raise StateError(f"state file {path!r} is not a wds_pad state file (expected keys "
                         "saved_by_rank, checksum, state)")
    if "format" not in doc:
        raise StateError(f"state file {path!r} was written by an earlier wds_pad 0.1 (a file without 'format'); "
                         "this wds_pad reads the files save_state_file writes now: start the epoch afresh")
    if doc["format"] != STATE_FILE_FORMAT:
        raise StateError(f"state file {path!r} is not a wds_pad state file (format {doc['format']!r})")
    if doc.get("checksum") != _checksum(doc["state"], doc["saved_by_rank"]):
        raise StateError(f"state file {path!r} is corrupt: its checksum does not match its "
                         "content; resume from an earlier checkpoint")
    saved_by = doc["saved_by_rank"]
    if not is_count(saved_by):
        raise StateError(f"state file {path!r}: field 'saved_by_rank' must be an int >= 0, got {saved_by!r}")
    if saved_by != rank:
        raise TopologyMismatchError(
            f"state file {path!r} was saved by rank {saved_by}, this is rank {rank}; "
            f"load {os.path.basename(state_path('', rank))} instead"
        )
    return check_schema(doc["state"])
