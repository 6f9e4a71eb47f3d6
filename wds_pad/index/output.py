"""Where an index is written: the output refused before anything is scanned, then the write.

Invariants:
- ``check_output`` is cheap (a few stats, one 8-byte read) and runs before any shard
  is scanned, so a refused output costs nothing; ``write_index`` runs it again just
  before writing;
- an output is never one of the input shards (also not through a symlink or hard
  link), never a directory or other non-regular file, and never an existing file
  that is not a wds_pad index unless ``force``; each refusal is a ``ConfigError`` that
  names the path and the fix;
- a local output's directory (or the nearest one that exists) is tried for real: a
  probe file is created, written (one byte) and removed, so a directory nobody may
  write in (``/sys``, ``/proc``, a read-only mount, also for root) and a full
  filesystem are refused before any scan;
- an http(s):// output is refused before any scan (wds_pad only reads over HTTP); a
  remote output whose store cannot be reached or found no credentials is a
  ``ReadError`` before any scan, and so is the write;
- the write is atomic: temp file + fsync + rename locally (``io.atomic``), a single PUT
  of the whole file elsewhere; a write that fails (no space left, the file size limit,
  an upload refused) is one ``WriteError`` naming the path and the fix, and leaves the
  path as it was (no partial file, no temp file);
- the file stores the shard URLs beside or below it relative to its folder
  (:meth:`Index.located`): an index built in memory, or loaded elsewhere (relocated or
  not), and written at ``path`` is the index a build with ``output=path`` writes.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
from typing import Any, Iterable, Mapping, Sequence

from ..core.policy import check_flag
from ..errors import ConfigError, WriteError
from ..io.atomic import atomic_write
from ..io.descriptors import out_of_descriptors, runs_out
from ..io.urls import local_path as _local
from .codec import serialize
from .layout import MAGIC
from .record import Index

__all__ = ["check_output", "write_index"]


def _refuse(path: str, why: str, fix: str = "choose another output path (-o)") -> ConfigError:
    return ConfigError(f"index output {path!r} {why}; {fix}")


_FORCE_FIX = "choose another output path (-o), or pass --force (force=True) to replace it"


def check_output(path: str, inputs: Sequence[str] = (), *, force: bool = False,
                 storage_options: Mapping[str, Any] | None = None) -> None:
    """Refuse an index output path that would destroy something or cannot be written.

    Cheap (a few stats, one 8-byte read), so it runs before any shard is scanned.

    Args:
        path: the output, a local path or fsspec URL.
        inputs: the shard URLs being indexed; the output must be none of them.
        force: allow replacing an existing file that is not a wds_pad index.
        storage_options: fsspec options for a remote output.

    Raises:
        ConfigError: an empty path; one of the inputs (also through a symlink or hard
            link); a directory or other non-regular file; an existing non-empty file
            that is not a wds_pad index (unless ``force``); a path whose parent is a
            file or not writable. The message names the path and the fix.
    """
    force = check_flag("force", force)  # "false" from a config file must not replace a file
    if not isinstance(path, str) or not path.strip():
        raise ConfigError(f"index output path is empty ({path!r}); give a file path, e.g. -o train.wdsidx")
    local = _local(path)
    if local is None:
        _check_remote(path, inputs, force, storage_options)
        return
    if not local:
        raise ConfigError(f"index output path is empty ({path!r}); give a file path, e.g. -o train.wdsidx")
    target = os.path.abspath(local)
    shards = {os.path.abspath(p): u for u in inputs if (p := _local(u))}
    for alias in (target, os.path.realpath(target)):
        if alias in shards:
            raise _refuse(path, f"is one of the input shards ({shards[alias]!r}); writing the index there "
                                "would destroy the shard")
    if local.endswith((os.sep, "/")) or os.path.isdir(target):
        raise _refuse(path, "is a directory",
                      f"give a file path, e.g. -o {os.path.join(local, 'train.wdsidx')!r}")
    try:
        st = os.stat(target)
    except FileNotFoundError:
        st = None
    except NotADirectoryError:
        st = None  # a parent is a file: reported below
    except OSError as exc:
        raise _refuse(path, f"cannot be checked ({exc.strerror or exc})") from exc
    if st is None:
        _check_parent(path, os.path.dirname(target))
        return
    if not stat.S_ISREG(st.st_mode):
        raise _refuse(path, "exists and is not a regular file (a device, pipe or socket)")
    for shard, url in shards.items():  # a symlink or hard link to a shard
        try:
            other = os.stat(shard)
        except OSError:
            continue
        if (other.st_dev, other.st_ino) == (st.st_dev, st.st_ino):
            raise _refuse(path, f"is the same file as the input shard {url!r}; writing the index there "
                                "would destroy the shard")
    _check_parent(path, os.path.dirname(target))
    if not force and st.st_size:
        try:
            with open(target, "rb") as f:
                head = f.read(len(MAGIC))
        except OSError as exc:
            raise _refuse(path, f"exists and cannot be read to check that it is a wds_pad index "
                                f"({exc.strerror or exc})", _FORCE_FIX) from exc
        if head != MAGIC:
            raise _refuse(path, f"exists and is not a wds_pad index ({st.st_size} bytes, no {MAGIC.decode()} "
                                "magic)", _FORCE_FIX)


def _check_parent(path: str, directory: str) -> None:
    """The nearest existing ancestor of the output must be a directory we can write into:
    a probe file is created there, written and removed (``os.access`` says yes to root
    in ``/sys`` and on a read-only mount)."""
    ancestor = directory
    while not os.path.lexists(ancestor) and os.path.dirname(ancestor) != ancestor:
        ancestor = os.path.dirname(ancestor)
    if not os.path.isdir(ancestor):
        raise _refuse(path, f"cannot be created: {ancestor!r} is a file, not a directory")
    probe = os.path.join(ancestor, f".wds-pad-probe.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
    except OSError as exc:
        if runs_out(exc):  # not the directory's fault: the process holds too many files
            raise out_of_descriptors(f"cannot create the index output {path!r}", exc,
                                     fewer="--workers (Python: build_index(..., workers=))") from exc
        raise _refuse(path, f"cannot be created: {_why_not(exc, ancestor)}", _fix(exc)) from exc
    try:
        os.write(fd, b"\0")  # a full filesystem takes an empty file, not a byte
    except OSError as exc:
        raise _refuse(path, f"cannot be written: {_why_not(exc, ancestor)}", _fix(exc)) from exc
    finally:
        os.close(fd)
        try:
            os.unlink(probe)
        except OSError:
            pass


def _why_not(exc: OSError, directory: str) -> str:
    """Why nothing can be written in ``directory``, in words."""
    reason = exc.strerror or str(exc)
    if exc.errno in (errno.EACCES, errno.EPERM):
        return f"no permission to write in directory {directory!r} ({reason})"
    if exc.errno == errno.EROFS:
        return f"directory {directory!r} is on a read-only filesystem"
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"the filesystem of directory {directory!r} is full ({reason})"
    return f"directory {directory!r} does not take new files ({reason})"


def _fix(exc: OSError) -> str:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return "free space there, or choose another output path (-o)"
    if exc.errno == errno.EFBIG:
        return "raise the file size limit (ulimit -f), or choose another output path (-o)"
    return "choose another output path (-o)"


def write_local(local: str, parts: Iterable[bytes | bytearray | memoryview], path: str,
                what: str = "the index") -> None:
    """Write ``parts`` to the local file ``local`` atomically (``path`` names it in errors).

    Raises:
        WriteError: the write failed (no space left, the file size limit, ...): the temp
            file is gone and ``local`` is as it was.
    """
    try:
        atomic_write(local, parts)
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise WriteError(f"cannot write {what} to {path!r}: {reason}"
                         f"{f' ({errno.errorcode[exc.errno]})' if exc.errno in errno.errorcode else ''}; "
                         f"nothing was written, {path!r} is as it was; {_fix(exc)}") from exc


#: protocols fsspec only reads from: an index output there is refused before any scan
_READ_ONLY = frozenset({"http", "https"})


def _check_remote(path: str, inputs: Sequence[str], force: bool,
                  storage_options: Mapping[str, Any] | None) -> None:
    from ..errors import ShardError
    from ..io.faults import call_store
    from ..io.fs import get_filesystem

    if path in set(inputs):
        raise _refuse(path, "is one of the input shards; writing the index there would destroy the shard")
    protocols = {part.partition("://")[0].lower() for part in path.split("::") if "://" in part}
    if protocols & _READ_ONLY:
        raise _refuse(path, f"is on {sorted(protocols & _READ_ONLY)[0]}://, which wds_pad only reads from",
                      "write the index to a local path or an object store (s3://, gs://, ...), then serve it "
                      "from there; shards over http(s) index fine into either")
    fs, fpath = get_filesystem(path, storage_options)
    try:  # a store that cannot be reached, or no credentials: a ReadError now, before any scan
        info = call_store(lambda: fs.info(fpath), path, what="index output")
    except ShardError:  # missing (the usual case), or forbidden to read: the write reports real faults
        return
    if info.get("type") == "directory":
        raise _refuse(path, "is a directory (a prefix with objects under it)",
                      f"give an object path, e.g. -o {path.rstrip('/')}/train.wdsidx")
    if force or not info.get("size"):
        return
    try:
        head = fs.cat_file(fpath, start=0, end=len(MAGIC))
    except OSError:
        return
    if head != MAGIC:
        raise _refuse(path, f"exists and is not a wds_pad index ({info.get('size')} bytes, no "
                            f"{MAGIC.decode()} magic)", _FORCE_FIX)


def write_index(index: Index, path: str, storage_options: Mapping[str, Any] | None = None, *,
                force: bool = False) -> str:
    """Write ``index`` to a local path or fsspec URL, atomically.

    Locally: a temp file in the same directory, fsync, then rename, so an interrupted
    write never leaves a half-written index (temps left by a killed writer are removed
    by the next successful write). Elsewhere: one PUT of the whole file.

    Args:
        index: the index to write.
        path: local path or fsspec URL; an existing wds_pad index there is replaced.
            Shard URLs beside or below it are stored relative to its folder, so the
            file's digest is of that form (``load_index(path).digest``; the in-memory
            ``index`` keeps its own unless it was built with ``output=path``).
        storage_options: fsspec options for remote paths.
        force: also replace an existing file that is not a wds_pad index.

    Returns:
        The path written.

    Raises:
        ConfigError: ``path`` is refused (see :func:`check_output`), checked before
            anything is written.
        WriteError: the write failed (no space left, the file size limit, a store that
            refuses the upload); ``path`` is as it was.
        ReadError: a remote store cannot be reached or has no credentials.
    """
    check_output(path, index.urls, force=force, storage_options=storage_options)
    parts = serialize(index.located(path))
    local = _local(path)
    if local is not None:
        write_local(local, parts, path)
        return local
    from ..io.faults import call_store
    from ..io.fs import get_filesystem

    fs, fpath = get_filesystem(path, storage_options)
    data = b"".join(bytes(p) for p in parts)
    call_store(lambda: fs.pipe_file(fpath, data), path, what="index output", missing=WriteError,
               fix="check the output URL (the bucket) and that these credentials may write there",
               action="write")
    return path
