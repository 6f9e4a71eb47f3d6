"""What goes wrong with a node's shard folder, said once, in one line naming it and the fix.

Invariants:
    * An entry named like a cache file that is not a regular file is foreign: reported
      once per folder and process (a warning), never removed nor counted.
    * A write the cache needs in a folder it cannot write, a file name taken by a foreign
      entry, a full disk: each one :class:`ConfigError` naming the folder (or entry), the
      figures where there are some, and the fix.
"""

from __future__ import annotations

import os
import stat
import warnings

from wds_pad.errors import ConfigError

from .redact import redact

__all__ = ["disk_full", "foreign", "unwritable"]

_REPORTED: set[str] = set()  # folders whose foreign entries were reported


def is_regular_file(path: str) -> bool:
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except FileNotFoundError:
        return True  # gone: nothing foreign


def report_once(folder: str, names: list[str]) -> None:
    if names and folder not in _REPORTED:
        _REPORTED.add(folder)
        warnings.warn(f"the node's shard folder {folder!r} holds {len(names)} entr{'y' if len(names) == 1 else 'ies'} "
                      f"named like its files that are not regular files ({', '.join(sorted(names)[:3])}"
                      f"{', ...' if len(names) > 3 else ''}); they are left alone and not counted: remove them",
                      UserWarning, stacklevel=2)


def foreign(path: str) -> ConfigError:
    """The error for a file name of the cache taken by something else (a directory, ...)."""
    return ConfigError(f"{path!r} in the node's shard folder is not a file the cache wrote (a directory or "
                       "another kind of entry), so the shard cannot be kept there; remove it, or pass another "
                       "ReadOptions(cache_dir=...)")


def unwritable(folder: str, exc: OSError) -> ConfigError:
    """The error for a write the cache needs in a folder it cannot write."""
    return ConfigError(f"the node's shard folder {folder!r} cannot be written ({exc.strerror or exc}), and a shard "
                       "it lacks must be fetched into it; make it writable, or pass ReadOptions(cache_dir=...) "
                       "with a writable folder on a local disk of the node")


def disk_full(folder: str, url: str, size: int, held: int, cache_bytes: int) -> ConfigError:
    """The error for a shard that does not fit the disk once unneeded shards are gone."""
    st = os.statvfs(folder)
    return ConfigError(
        f"the disk of the node's shard folder {folder!r} is full: {st.f_bavail * st.f_frsize} bytes free, the "
        f"folder holds {held} bytes of shards the plans still read and {redact(url)!r} needs {size}; lower "
        f"ReadOptions.cache_bytes (now {cache_bytes}) below what the disk can hold, or free the disk, or pass "
        "another cache_dir")
