"""Where a node's processes keep their shards: ``cache_dir``, or a folder of the job's own.

A job that names a ``cache_dir`` keeps its shards there, across epochs and jobs (a local
disk of the node). A job that names none still shares one copy per node when its
processes are several (a torchrun job with more than one process per node, or DataLoader
workers): in ``<temp dir>/wds_pad-node-<digest>``, the digest of the user and the job's
name (``TORCHELASTIC_RUN_ID``, else ``MASTER_ADDR:MASTER_PORT``, else the main process's
id), which the job removes when it ends.

Invariants:
    * Every process using a default folder holds a shared ``flock`` of its ``.users``
      while it runs; at exit, once its children (DataLoader workers) have ended, a process
      that can take it exclusive is the last one, and removes the folder: after a clean
      exit of all its processes no folder is left, not even an empty one. The kernel drops
      the locks of a process that dies, so a folder whose ``.users`` lock is free belongs
      to nobody: the next job that opens its own default folder removes it.
    * A folder appears whole (made as a temp folder holding ``.users``, then renamed) and
      goes whole (renamed aside under the exclusive lock, then deleted): a process that
      joins checks, holding its shared lock, that the path still names that ``.users``.
    * A default folder is the user's alone (mode 0o700); one owned by another user is
      refused, naming the path and the fix.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import multiprocessing.util
import os
import secrets
import shutil
import tempfile
import threading
from typing import Mapping

from wds_pad.errors import ConfigError

from .nodefiles import same_file

__all__ = ["default_folder", "job_name", "job_session", "node_folder"]

PREFIX = "wds_pad-node-"
_TRASH = ".wds_pad-trash-"
_FLAGS = getattr(os, "O_CLOEXEC", 0)
_JOINED: dict[str, int] = {}  # default folders this process uses -> its .users descriptor
_GUARD = threading.Lock()
_SWEPT = False


def _forget() -> None:
    # a forked child shares its parent's lock through these descriptors: it takes its own
    global _SWEPT
    for fd in _JOINED.values():
        with contextlib.suppress(OSError):
            os.close(fd)
    _JOINED.clear()
    _SWEPT = True  # the parent swept already


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget)


def job_name(env: Mapping[str, str] | None = None, in_worker: bool | None = None) -> str:
    """The name of the job this process belongs to, the same in every process of it on a
    node: torchrun's run id, else its rendezvous address, else the main process's id."""
    env = os.environ if env is None else env
    run = env.get("TORCHELASTIC_RUN_ID", "")
    if run and run != "none":
        return f"run {run}"
    addr, port = env.get("MASTER_ADDR", ""), env.get("MASTER_PORT", "")
    if addr and port:
        return f"master {addr}:{port}"
    worker = _in_dataloader_worker() if in_worker is None else in_worker
    return f"pid {os.getppid() if worker else os.getpid()}"


def _started(pid: int) -> str:
    """The boot-relative start time of process ``pid`` (``/proc``), or ``""``."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rpartition(b")")[2].split()
        return fields[19].decode()
    except (OSError, IndexError):
        return ""


def _parent(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rpartition(b")")[2].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def job_session(env: Mapping[str, str] | None = None, in_worker: bool | None = None) -> str:
    """This run of the job on this node, the same in all its processes there: the job's
    name and the process that started them (the launcher of the ranks: torchrun's agent,
    ``mp.spawn``'s parent; the main process of a job of one), with its start time, so a
    job started again under the same name is another session."""
    name = job_name(env, in_worker)
    worker = _in_dataloader_worker() if in_worker is None else in_worker
    main = os.getppid() if worker else os.getpid()
    lead = main if name.startswith("pid ") else _parent(main)
    return f"{name} {lead}@{_started(lead)}"


def default_folder(job: str | None = None) -> str:
    """The default folder of ``job`` (default: this process's, :func:`job_name`)."""
    digest = hashlib.blake2b(f"{os.getuid()}\0{job or job_name()}".encode(), digest_size=8).hexdigest()
    return os.path.join(tempfile.gettempdir(), PREFIX + digest)


def node_folder(cache_dir: str | None, *, workers: int, local_world_size: int | None) -> str | None:
    """The folder the node's processes share shards in: ``cache_dir`` (made if missing);
    else, when this node runs several processes of the job (``local_world_size`` > 1, or
    DataLoader ``workers`` > 1), the job's default folder, joined; else None (one
    process: its shards stay in memory).

    Raises:
        ConfigError: the folder cannot be made or used.
    """
    if cache_dir is not None:
        try:
            os.makedirs(cache_dir, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"ReadOptions.cache_dir {cache_dir!r} cannot be made ({exc}); "
                              "give a writable folder on a local disk of the node") from exc
        return cache_dir
    if (local_world_size or 1) <= 1 and workers <= 1:
        return None
    return join(default_folder())


def join(path: str) -> str:
    """Uses the default folder ``path`` until this process exits (made if missing)."""
    with _GUARD:
        if path in _JOINED:
            return path
        root = os.path.dirname(path)
        for _ in range(100):
            if not os.path.isdir(path):
                _make(path)
            _check_owner(path)
            try:
                fd = os.open(os.path.join(path, ".users"), os.O_RDWR | _FLAGS)
            except FileNotFoundError:
                continue  # removed meanwhile: make it again
            fcntl.flock(fd, fcntl.LOCK_SH)  # waits while the last user removes it
            if same_file(fd, os.path.join(path, ".users")):
                _JOINED[path] = fd
                if len(_JOINED) == 1:
                    # at exit, after multiprocessing ended this process's children (DataLoader
                    # workers, persistent ones too, hold the lock as well): an atexit handler
                    # would run before them, find the lock held and leave the folder behind
                    multiprocessing.util.Finalize(None, _leave_all, exitpriority=-100)
                break
            os.close(fd)
        else:  # pragma: no cover - 100 removals in a row
            raise ConfigError(f"the default shard folder {path!r} keeps being removed; pass "
                              "ReadOptions(cache_dir=...)")
    _sweep(root, keep=path)
    return path


def _make(path: str) -> None:
    root = os.path.dirname(path)
    tmp = tempfile.mkdtemp(prefix=os.path.basename(path) + ".", suffix=".tmp", dir=root)  # mode 0o700
    os.close(os.open(os.path.join(tmp, ".users"), os.O_RDWR | os.O_CREAT | _FLAGS, 0o600))
    try:
        os.rename(tmp, path)
    except OSError:  # made by another process meanwhile
        shutil.rmtree(tmp, ignore_errors=True)


def _check_owner(path: str) -> None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not os.path.isdir(path) or os.path.islink(path) or st.st_uid != os.getuid():
        raise ConfigError(f"the default shard folder {path!r} is not a folder of this user; remove it, or "
                          "pass ReadOptions(cache_dir=...) with a folder of your own")


def _remove_if_unused(path: str, fd: int | None = None) -> bool:
    """Renames the folder aside and deletes it if nobody holds its ``.users`` lock."""
    users = os.path.join(path, ".users")
    own = fd is None
    if own:
        try:
            fd = os.open(users, os.O_RDONLY | _FLAGS)
        except OSError:
            return False
    assert fd is not None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        if not same_file(fd, users):
            return False
        trash = os.path.join(os.path.dirname(path), _TRASH + secrets.token_hex(6))
        try:
            os.rename(path, trash)
        except OSError:
            return False
    finally:
        if own:
            os.close(fd)
    shutil.rmtree(trash, ignore_errors=True)
    return True


def _sweep(root: str, keep: str) -> int:
    """Removes the default folders in ``root`` of this user that no process uses (their
    jobs ended without removing them: killed, or crashed), once per process."""
    global _SWEPT
    if _SWEPT:
        return 0
    _SWEPT = True
    removed = 0
    try:
        names = os.listdir(root)
    except OSError:
        return 0
    uid = os.getuid()
    for name in names:
        path = os.path.join(root, name)
        if path == keep or not (name.startswith(PREFIX) or name.startswith(_TRASH)):
            continue
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if st.st_uid != uid or not os.path.isdir(path) or os.path.islink(path):
            continue
        if name.startswith(_TRASH):
            shutil.rmtree(path, ignore_errors=True)  # renamed aside by a process that died deleting it
            removed += 1
        else:
            removed += _remove_if_unused(path)
    return removed


def _leave_all() -> None:
    """At exit: each default folder this process used is removed if it was its last user."""
    with _GUARD:
        joined = dict(_JOINED)
        _JOINED.clear()
    for path, fd in joined.items():
        try:
            _remove_if_unused(path, fd)
        except OSError:  # pragma: no cover - best effort at exit
            pass
        finally:
            with contextlib.suppress(OSError):
                os.close(fd)


def _in_dataloader_worker() -> bool:
    try:
        from torch.utils.data import get_worker_info
    except ImportError:  # pragma: no cover
        return False
    return get_worker_info() is not None
