"""The process's file-descriptor limit: how many descriptors a cache of shards may hold,
and what running out means.

Every place that keeps shard files open (the range reader's descriptors, the read-ahead
pins, the index scan's open shards) sizes itself here, and says the same thing when the
process runs out.

Invariants:
    * :func:`fd_budget` is a fraction of the soft ``RLIMIT_NOFILE`` read now (not at
      import: a job may lower or raise it later), at least 1 and at most 4096; the rest
      of the limit stays free for the process's other descriptors (DataLoader pipes,
      sockets, the trainer's own files).
    * Running out of descriptors (``EMFILE`` for the process, ``ENFILE`` for the system)
      is never blamed on a shard: :func:`out_of_descriptors` is a :class:`ReadError` that
      names the limit and how to raise it, never "check the path".
"""

from __future__ import annotations

import errno

from wds_pad.errors import ReadError

__all__ = ["fd_budget", "out_of_descriptors", "runs_out", "soft_limit"]

_MOST = 4096  # descriptors one cache keeps at most, however high the limit


def soft_limit() -> int | None:
    """The process's soft ``RLIMIT_NOFILE``; None where unknown or unlimited."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):  # pragma: no cover - not a POSIX system
        return None
    return None if soft == resource.RLIM_INFINITY or soft < 0 else int(soft)


def fd_budget(share: int = 4) -> int:
    """Descriptors one cache may hold: ``1/share`` of the soft limit, 1 to 4096.

    Args:
        share: the fraction of the limit given to the cache (4: a quarter).
    """
    soft = soft_limit()
    return _MOST if soft is None else max(1, min(_MOST, soft // share))


def runs_out(exc: BaseException) -> bool:
    """Whether ``exc`` says the process (EMFILE) or the system (ENFILE) has no descriptor left."""
    return isinstance(exc, OSError) and exc.errno in (errno.EMFILE, errno.ENFILE)


def out_of_descriptors(what: str, exc: OSError, *, fewer: str, held: int | None = None) -> ReadError:
    """The error for running out of descriptors while doing ``what``.

    Args:
        what: what failed, naming the shard (``cannot open shard 'x.tar'``).
        exc: the ``EMFILE`` / ``ENFILE`` error.
        fewer: what to use fewer of (``"DataLoader workers"``, ``"--workers"``).
        held: shard descriptors the cache still held when it failed (after closing its
            idle ones), if it keeps any.
    """
    soft = soft_limit()
    limit = "unlimited" if soft is None else str(soft)
    if exc.errno == errno.ENFILE:
        cause = "the system's table of open files is full (ENFILE)"
        fix = "close other programs' files, or raise the system's limit (sysctl fs.file-max)"
    else:
        cause = f"this process has no file descriptor left (EMFILE; soft limit RLIMIT_NOFILE {limit})"
        fix = (f"raise the limit (`ulimit -n {max(4096, 4 * (soft or 0))}` in the shell that starts the job, "
               f"or resource.setrlimit), or use fewer {fewer}")
    here = "" if held is None else f", {held} of them held by shards the reader is reading"
    return ReadError(f"{what}: {cause}{here}; {fix}")
