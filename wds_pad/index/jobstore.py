"""The store side of a distributed indexing job: heartbeats, status keys, waiting
without hanging.

Every rank of the job talks through the process group's key-value store (torchrun's
agent store, or rank 0's): no collective waits on a rank that is still scanning.

Invariants:
- a job's keys live under ``wds_pad/index/<job>/``, ``<job>`` drawn by rank 0 once per
  job, so jobs run one after another in one process group never see each other's keys;
- each rank beats (a counter it adds to every second, from a thread); a wait names the
  rank whose beat stood still for ``timeout`` seconds, and never waits longer;
- a failure is a status ``{"ok": False, "rank", "type", "message"}``; :func:`job_error`
  turns it back into the ``wds_pad.errors`` class it came from (else ``WdsPadError``);
- a lost store (its host is gone) is a ``ReadError`` naming MASTER_ADDR:MASTER_PORT.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any, Callable, Iterable, Mapping

import wds_pad.errors as _errors  # job_error looks a class up by name

from ..core.collective import default_store
from ..errors import ReadError, WdsPadError

__all__ = ["Job", "failure", "job_error", "linger", "new_job_id"]

_KEY = "wds_pad/index/"
_BEAT = 1.0  # seconds between heartbeats
_POLL = 0.2  # seconds between looks at the store while waiting


def new_job_id() -> int:
    """(Rank 0) a number no earlier job of this process group's store has used."""
    return int(default_store().add(_KEY + "jobs", 1))


class Job:
    """The store side of the job: heartbeats, status keys and waiting without hanging."""

    def __init__(self, job_id: int, rank: int, world: int, timeout: float, bar: Any = None) -> None:
        self.rank, self.world, self.timeout = rank, world, timeout
        self.prefix = f"{_KEY}{job_id}/"
        self.store = default_store()
        self.bar = bar
        self._stop = threading.Event()
        self.store.add(f"{self.prefix}beat/{rank}", 1)
        self._thread = threading.Thread(target=self._beat, name="wds_pad-index-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(_BEAT):
            try:
                self.store.add(f"{self.prefix}beat/{self.rank}", 1)
                if self.bar is not None:
                    done = self.store.add(f"{self.prefix}parts_done", 0)
                    self.bar.update(max(0, done - self.bar.n))
            except Exception:  # noqa: BLE001 - the store is gone: the main thread reports it
                return

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def call(self, what: str, op: Callable[[], Any]) -> Any:
        try:
            return op()
        except Exception as exc:  # noqa: BLE001 - c10d raises RuntimeError/DistStoreError
            where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
            raise ReadError(f"rank {self.rank}: lost the job's store at {where} while {what} ({exc}); "
                            "rank 0 (or torchrun) has stopped; rerun the command: finished parts are kept") from exc

    def set(self, key: str, value: Any) -> None:
        self.call(f"setting {key}", lambda: self.store.set(self.prefix + key, json.dumps(value)))

    def get(self, key: str) -> Any:
        return json.loads(self.call(f"reading {key}", lambda: self.store.get(self.prefix + key)))

    def has(self, key: str) -> bool:
        return bool(self.call(f"checking {key}", lambda: self.store.check([self.prefix + key])))

    def add(self, key: str, n: int) -> int:
        return int(self.call(f"counting {key}", lambda: self.store.add(self.prefix + key, n)))

    def stopped(self) -> dict[str, Any] | None:
        """Rank 0's verdict if it has stopped the job (a rank failed), else None."""
        if self.has("verdict"):
            verdict: dict[str, Any] = self.get("verdict")
            if not verdict["ok"]:
                return verdict
        return None

    def all_done(self) -> dict[str, Any] | None:
        """(Rank 0) the first failed rank's status, ``{"ok": True}`` once all are done, else None."""
        if self.add("failed", 0):
            for r in range(self.world):
                if self.has(f"done/{r}") and not (status := self.get(f"done/{r}"))["ok"]:
                    return status  # type: ignore[no-any-return]
        return {"ok": True} if self.add("done_n", 0) >= self.world else None

    def outcome(self) -> dict[str, Any] | None:
        """(Other ranks) the merge's outcome, or the job's failure, else None."""
        if self.has("merged"):
            return self.get("merged")  # type: ignore[no-any-return]
        return self.stopped()

    def wait(self, ready: Callable[[], Any], ranks: Iterable[int], what: str) -> Any:
        """Poll until ``ready()`` returns something; meanwhile fail if one of ``ranks``
        stops beating for ``timeout`` seconds (named in the error)."""
        watched = list(ranks)
        last = {r: (self.add(f"beat/{r}", 0), time.monotonic()) for r in watched}
        while True:
            got = ready()
            if got is not None:
                return got
            now = time.monotonic()
            for r in watched:
                beat = self.add(f"beat/{r}", 0)
                if beat != last[r][0]:
                    last[r] = (beat, now)
                elif now - last[r][1] > self.timeout:
                    raise ReadError(
                        f"rank {r} stopped answering while {what} (no heartbeat for {self.timeout:.0f} s): it was "
                        "killed or hangs; rerun the command (finished parts are kept), or raise --timeout")
            time.sleep(_POLL)


def job_error(status: Mapping[str, Any]) -> WdsPadError:
    """The error a status names (its class from wds_pad.errors, else WdsPadError)."""
    cls = getattr(_errors, str(status.get("type")), None)
    if not (isinstance(cls, type) and issubclass(cls, WdsPadError)):
        cls = WdsPadError
    return cls(status["message"])


def failure(rank: int, exc: BaseException) -> dict[str, Any]:
    """The status of ``rank`` failing with ``exc`` (an interrupt too), for the others."""
    kind = type(exc).__name__ if isinstance(exc, WdsPadError) else "WdsPadError"
    return {"ok": False, "rank": rank, "type": kind, "message": f"rank {rank} failed: {type(exc).__name__}: {exc}"}


def linger(job: Job) -> None:
    """Rank 0 hosts the store when no torchrun agent does: before it exits, give the
    other ranks (up to 30 s) to read the outcome, so they report it, not a lost store."""
    expected = job.world - 1 - job.add("failed", 0) + (1 if job.has("done/0") and not job.get("done/0")["ok"] else 0)
    deadline = time.monotonic() + min(job.timeout, 30.0)
    while job.add("ack", 0) < expected and time.monotonic() < deadline:
        time.sleep(_POLL)


