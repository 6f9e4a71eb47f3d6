"""DataLoader workers that are known to have started: a forked worker stuck in the fork is replaced.

Invariants:
- with the ``fork`` start method, every worker marks itself started (a flag in shared
  memory, set by our ``worker_init_fn`` before the user's) and no batch is taken from the
  workers before each one has, or has exited (the DataLoader then reports why);
- a worker that has not started within ``start_timeout`` seconds is stuck inside the fork:
  the attempt is shut down (the stuck process is killed, never left holding the job's
  pipes), a :class:`WorkerStartWarning` names it, and the same DataLoader is made again,
  from the same pinned dataset: no batch was handed out, so nothing is lost or repeated;
- after ``ATTEMPTS`` attempts a :class:`WorkerStartError` says what to change;
- ``spawn`` and ``forkserver`` workers are started from a process with one thread and
  are not watched;
- a ``fork`` or ``spawn`` worker whose starting process is gone by the time it runs its
  ``worker_init_fn`` (the main process killed while the worker still started) exits there:
  torch's watchdog, made after that call, would take init for its parent and never end;
- the loaders shut their DataLoader iterator down (:func:`shut_down`) however their loop
  ends, an error included, in the process that started its workers: an iterator left to
  the garbage collector may be collected in a later forked child, where torch's
  ``__del__`` cannot test another process's children and prints an ignored error;
- a worker that dies while the loop runs (a signal, the out-of-memory killer, a crash)
  ends it with one :class:`WorkerError` naming the worker, its pid and how it ended,
  raised where the loop asks for its next batch (:func:`watched`): torch's SIGCHLD
  handler, which raises a bare RuntimeError wherever the main thread happens to be (in
  the training step too), is not told about our workers; torch's own check of its
  workers, every few seconds while a batch is awaited, finds the dead one;
- an error raised in a worker is that error (torch re-raises it), never a WorkerError,
  even when torch has stopped that worker by then (it exits with 0).

Why: CPython 3.11.9 and older (gh-112275, fixed in 3.11.10 and 3.12) can deadlock a forked
child when another thread holds the interpreter's thread-state lock at the moment of the
fork, as torch's gloo threads do when they take the GIL around a collective's completion.
The child then never runs a line of Python: under DDP (Lightning, Fabric) the epoch's
first batch never came, about once in fifteen two-rank jobs here. Other C libraries
(OpenBLAS, OpenMP) have fork deadlocks of their own; the watch covers them all.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import re
import signal
import time
import warnings
from typing import Any, Callable, Iterator

from torch.autograd import profiler
from torch.utils.data import DataLoader

from ..errors import WorkerError, WorkerStartError, WorkerStartWarning

__all__ = ["ATTEMPTS", "START_TIMEOUT", "kept_workers", "resumed", "shut_down", "watched", "worker_batches"]

START_TIMEOUT = 10.0  # seconds for a forked worker to reach its worker_init_fn
ATTEMPTS = 3
_POLL = 0.005


class _MarkStarted:
    """``worker_init_fn``: end this worker if the process that started it is gone, set its
    started flag (fork), then run the user's ``worker_init_fn``.

    torch's watchdog takes the worker's parent pid after ``worker_init_fn``: a worker still
    starting when the main process was killed would take init's pid for its parent's and
    serve nobody for ever, holding the job's shared memory. ``parent`` is the pid a worker
    of ``fork`` and ``spawn`` has for parent (forkserver's are the server's: not checked)."""

    def __init__(self, flags: Any, user: Callable[[int], Any] | None, parent: int | None) -> None:
        self.flags, self.user, self.parent = flags, user, parent

    def __call__(self, worker_id: int) -> None:
        if self.parent is not None and os.getppid() != self.parent:
            os._exit(0)  # nobody is left to hand a batch or an error to
        if self.flags is not None:
            self.flags[worker_id] = 1
        if self.user is not None:
            self.user(worker_id)


def start_method(context: Any) -> str:
    """The start method a DataLoader with ``multiprocessing_context=context`` uses, without
    fixing the process's default (``multiprocessing.get_context()`` would)."""
    if context is None:
        return multiprocessing.get_start_method(allow_none=True) or multiprocessing.get_all_start_methods()[0]
    if isinstance(context, str):
        return context
    return context.get_start_method()


def _wait_started(batches: Any, flags: Any, timeout: float) -> list[int]:
    """The worker ids not started after ``timeout`` seconds (none: all started, or one exited)."""
    workers = list(getattr(batches, "_workers", ()))
    deadline = time.monotonic() + timeout
    while True:
        waiting = [i for i in range(len(flags)) if not flags[i]]
        if not waiting or any(w.exitcode is not None for w in workers):
            return []
        if time.monotonic() >= deadline:
            return waiting
        time.sleep(_POLL)


def _shut_down(batches: Any) -> None:
    """Stop an attempt's workers; kill the ones that cannot stop (stuck before any Python)."""
    shutdown = getattr(batches, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()  # unregisters the pids from torch's SIGCHLD check first, then joins
    for w in getattr(batches, "_workers", ()):
        if w.is_alive():
            w.kill()
            w.join(timeout=5)
        if not w.is_alive():  # one killed (by us, torch's terminate, or anyone) while it made a segment
            _remove_segments(w.pid)


def shut_down(batches: Any) -> None:
    """Stop the workers of a DataLoader iterator now; nothing in any other process than
    the one that started them (a forked child holds a copy it must leave alone)."""
    workers = getattr(batches, "_workers", ())
    if any(getattr(w, "_parent_pid", None) != os.getpid() for w in workers):
        return
    _shut_down(batches)


def _unwatch_sigchld(batches: Any) -> None:
    """Keep torch's SIGCHLD handler off these workers (see the module doc). Best effort:
    torch's private registry; without it, the handler's bare RuntimeError can surface in
    the training step, and :func:`watched` still turns the one it sees into a WorkerError."""
    try:
        from torch.utils.data._utils import signal_handling

        if getattr(batches, "_worker_pids_set", False):
            signal_handling._remove_worker_pids(id(batches))
            batches._worker_pids_set = False
    except Exception:  # noqa: BLE001 - another torch: its handler stays
        pass


def _ended(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        hint = " (on Linux often the kernel's out-of-memory killer: see dmesg)" if -code == signal.SIGKILL else ""
        return f"was killed by {name}{hint}"
    return "exited" if code is None else f"exited with code {code}"


def _dead_workers(batches: Any, wait: float, named: set[int] | None = None) -> list[tuple[int, Any]]:
    """The workers of ``batches`` that ended, waiting up to ``wait`` seconds for one that is
    dying to be reaped. With ``named`` (the pids torch's error calls dead), one that exited
    with 0 counts only if named there: torch stops a worker whose dataset raised (it exits
    with 0) as soon as the end of its iteration reaches the main process, which can be
    before the main process comes, in plan order, to the error the worker sent, then
    re-raised: that error is the cause, not a death."""
    workers = list(getattr(batches, "_workers", ()))
    deadline = time.monotonic() + wait
    while True:
        dead = [(i, w) for i, w in enumerate(workers)
                if w.exitcode is not None and (w.exitcode != 0 or named is None or w.pid in named)]
        if dead or time.monotonic() >= deadline:
            return dead
        time.sleep(0.05)


def _remove_segments(pid: int | None, root: str = "/dev/shm") -> int:
    """Removes the named shared memory a dead worker ``pid`` left: torch names a segment
    ``torch_<pid>_<n>_<k>`` and unlinks it right after making it, so a name is left only by
    a process killed in between, which nobody can open any more. Returns how many it removed."""
    if pid is None:
        return 0
    removed = 0
    try:
        names = os.listdir(root)
    except OSError:
        return 0
    for name in names:
        if name.startswith(f"torch_{pid}_"):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(root, name))
                removed += 1
    return removed


def watched(batches: Any, owner: str) -> Iterator[Any]:
    """The items of a DataLoader iterator made by :func:`worker_batches`; a worker that
    died ends them with one WorkerError (the module doc).

    Raises:
        WorkerError: a worker died; names it, its pid and how it ended.
    """
    while True:
        try:
            item = _next_item(batches)
        except StopIteration:
            return
        except (RuntimeError, ConnectionError, EOFError) as exc:
            _raise_if_died(batches, owner, exc)
            raise  # a worker's own error, re-raised by torch: it says what went wrong
        yield item


def _next_item(batches: Any) -> Any:
    """The DataLoader iterator's next item. Its ``__next__`` opens a profiler span
    (``record_function``) around each item, whether a profiler runs or not: about a third
    of what a message costs the main process here (25 of 73 us). So, while no profiler
    runs, the item is taken as ``__next__`` takes it, without the span; under a profiler,
    through ``__next__``, so the traces show the loading as they always did."""
    if getattr(profiler, "_is_profiler_enabled", True) or getattr(batches, "_sampler_iter", None) is None \
            or not hasattr(batches, "_next_data"):  # a profiler runs, or another torch: as it always was
        return next(batches)
    item = batches._next_data()
    batches._num_yielded += 1
    return item


def _raise_if_died(batches: Any, owner: str, exc: BaseException, when: str = "while the loop ran") -> None:
    """Raise a WorkerError if ``exc`` (raised by ``batches``) means a worker died."""
    # RuntimeError: torch saw the worker gone; ConnectionError/EOFError: it died while
    # the main process fetched a batch's shared memory from it (torch's resource sharer)
    said = re.search(r"pid\(s\) ([\d, ]+)\) exited unexpectedly", str(exc))
    named = {int(p) for p in said.group(1).split(",") if p.strip()} if said else set()
    dead = _dead_workers(batches, wait=0.0 if isinstance(exc, RuntimeError) else 2.0, named=named)
    if not dead and (not isinstance(exc, RuntimeError) or
                     not any(m in str(exc) for m in ("exited unexpectedly", "killed by signal"))):
        return
    which = "; ".join(f"worker {i} (pid {w.pid}) {_ended(w.exitcode)}" for i, w in dead) or str(exc)
    raise WorkerError(
        f"{owner}: a DataLoader worker died {when}: {which}. The loop cannot go on "
        f"without its batches; {owner.lower()}.state_dict() still holds the last batch the loop "
        "received, so restart from it (with fewer workers, or more memory, if it ran out)") from exc


def resumed(loader: Any, batches: Any, owner: str) -> Iterator[Any]:
    """The iterator of kept workers (``persistent_workers``, made by :func:`kept_workers`)
    iterating their datasets again: ``iter(loader)`` tells each worker to (torch's reset),
    and a worker that died meanwhile is one WorkerError, as in :func:`watched` (at once: the
    reset would wait for its answer for torch's status interval first)."""
    when = "while it was kept between iterations (persistent_workers)"
    if _dead_workers(batches, wait=0.0):
        _raise_if_died(batches, owner, RuntimeError("exited unexpectedly"), when)
    try:
        return iter(loader)
    except (RuntimeError, ConnectionError, EOFError) as exc:
        _raise_if_died(batches, owner, exc, when)
        raise


def worker_batches(dataset: Any, num_workers: int, kwargs: dict[str, Any], *, owner: str,
                   start_timeout: float = START_TIMEOUT) -> Iterator[Any]:
    """A DataLoader iterator over ``dataset`` whose workers have all started (:func:`kept_workers`
    without keeping them: they end with the iteration)."""
    return kept_workers(dataset, num_workers, kwargs, owner=owner, start_timeout=start_timeout, keep=False)[1]


def kept_workers(dataset: Any, num_workers: int, kwargs: dict[str, Any], *, owner: str,
                 start_timeout: float = START_TIMEOUT, keep: bool = True) -> tuple[Any, Iterator[Any]]:
    """A DataLoader over ``dataset`` and its first iterator, whose workers have all started.

    ``keep``: the DataLoader keeps its workers when an iteration ends
    (``persistent_workers``): :func:`resumed` iterates them again, :func:`shut_down` ends them.

    Args:
        dataset: what the workers iterate (copied into each as it is now).
        num_workers: at least 1.
        kwargs: the other DataLoader keywords (``worker_init_fn`` is kept, run after ours).
        owner: the loader's name, for the messages.
        start_timeout: seconds a forked worker may take to start.

    Returns:
        The DataLoader and its iterator, the workers started.

    Raises:
        WorkerStartError: a worker was stuck in the fork in each of ``ATTEMPTS`` attempts.
    """
    method = start_method(kwargs.get("multiprocessing_context"))
    kwargs = dict(kwargs, persistent_workers=keep)
    if method != "fork":
        parent = os.getpid() if method == "spawn" else None
        given = dict(kwargs, worker_init_fn=_MarkStarted(None, kwargs.get("worker_init_fn"), parent))
        loader = DataLoader(dataset, batch_size=None, num_workers=num_workers, **given)
        batches = iter(loader)
        _unwatch_sigchld(batches)
        return loader, batches
    fork = multiprocessing.get_context("fork")
    stuck: list[int] = []
    for attempt in range(1, ATTEMPTS + 1):
        flags = fork.RawArray("b", num_workers)
        given = dict(kwargs, worker_init_fn=_MarkStarted(flags, kwargs.get("worker_init_fn"), os.getpid()))
        loader = DataLoader(dataset, batch_size=None, num_workers=num_workers, **given)
        batches = iter(loader)
        _unwatch_sigchld(batches)
        stuck = _wait_started(batches, flags, start_timeout)
        if not stuck:
            return loader, batches
        pids = [getattr(batches, "_workers", [None] * num_workers)[i] for i in stuck]
        _shut_down(batches)
        if attempt < ATTEMPTS:
            warnings.warn(WorkerStartWarning(
                f"{owner}: DataLoader worker(s) {stuck} (pid {[getattr(p, 'pid', None) for p in pids]}) did not "
                f"start within {start_timeout:g} s of the fork (stuck in it: on CPython 3.11.9 and older a "
                "thread of the parent, such as a torch.distributed one, can leave a lock held in the child, "
                f"gh-112275); the workers were stopped and started again (attempt {attempt + 1} of {ATTEMPTS}). "
                "No batch was handed out, so the plan continues exactly"), stacklevel=3)
    raise WorkerStartError(
        f"{owner}: DataLoader worker(s) {stuck} did not start within {start_timeout:g} s of the fork in "
        f"{ATTEMPTS} attempts. If the machine is overloaded, raise worker_start_timeout=; otherwise start "
        "workers without fork: multiprocessing_context='forkserver' (the training script then needs an "
        "`if __name__ == \"__main__\":` guard), or use CPython 3.11.10 or newer")
