"""Where data time goes on this rank: :class:`StreamStats`, and the clock that counts it.

Invariants:
- counters are always on and cost a few ``time.perf_counter_ns`` calls per batch (and
  one per remote request, in the reader): never per sample;
- ``wait_s`` is the time the training loop spent inside ``next()`` on the dataset or
  the Loader, in the main process;
- the stages split the time spent making batches: ``get_s`` and ``cache_wait_s`` are the
  waits of the reading thread on its ranged GETs and on the shard cache (the reader's
  :class:`~wds_pad.io.options.ReadStats`), ``collate_s`` is collation, ``tar_s`` the rest
  of making a batch (local reads, tar headers and members, per-sample stages);
  ``transport_s`` is the main process's wait on its DataLoader workers' messages. In one
  process the stages add up to ``wait_s``; with workers they are summed over the
  workers, whose work overlaps the training step;
- a DataLoader worker sends its counters with the batches it already sends (the last
  element of each message, a :class:`WorkerNote`), never on a channel of its own; the
  main process keeps each worker's latest and sums them.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any, Iterable, Iterator

from torch.utils.data import get_worker_info

from .transport import PackedRun

__all__ = ["Clock", "StreamStats", "WorkerNote"]

_COUNTS = ("wait_ns", "batches", "make_ns", "collate_ns", "unpack_ns", "transport_ns",
           "gets", "get_bytes", "cache_hits", "get_wait_ns", "cache_wait_ns")
_READER = ("gets", "get_bytes", "cache_hits", "get_wait_ns", "cache_wait_ns")
STAGES = ("get_s", "cache_wait_s", "tar_s", "collate_s", "transport_s")


@dataclass(frozen=True)
class StreamStats:
    """Where this rank's data time went, since its dataset was made (``as_dict()`` to log).

    Attributes:
        rank: this process's data-parallel rank.
        wait_s: seconds the training loop spent inside ``next()`` (main process).
        batches: batches the training loop received.
        gets: GETs sent to a remote store (retries and whole-shard blocks included).
        bytes_read: bytes those GETs returned.
        cache_hits: reads the shard cache answered with bytes it already held.
        get_s: seconds the reading threads waited on their own ranged GETs.
        cache_wait_s: seconds they waited on the shard cache (memory or the node's copies).
        tar_s: seconds of the rest of making batches: local reads, tar members, stages.
        collate_s: seconds of collation (in the workers and in the main process).
        transport_s: seconds the main process waited on its workers' messages.
        slowest_shard: the shard URL with the most GET and cache wait ("" if none).
        slowest_shard_s: that wait, in seconds.
    """

    rank: int = 0
    wait_s: float = 0.0
    batches: int = 0
    gets: int = 0
    bytes_read: int = 0
    cache_hits: int = 0
    get_s: float = 0.0
    cache_wait_s: float = 0.0
    tar_s: float = 0.0
    collate_s: float = 0.0
    transport_s: float = 0.0
    slowest_shard: str = ""
    slowest_shard_s: float = 0.0

    @property
    def stages(self) -> dict[str, float]:
        """Seconds per stage: ``get_s``, ``cache_wait_s``, ``tar_s``, ``collate_s``, ``transport_s``."""
        return {k: getattr(self, k) for k in STAGES}

    def as_dict(self) -> dict[str, Any]:
        """The fields as a plain dict (JSON-safe)."""
        return asdict(self)


@dataclass(frozen=True)
class WorkerNote:
    """A worker's counters of its current iteration, riding at the end of a message."""

    worker: int
    counts: dict[str, int]
    by_url: dict[str, int]


def _add(into: dict[str, int], counts: dict[str, int]) -> None:
    for k, v in counts.items():
        into[k] = into.get(k, 0) + v


class Clock:
    """The counters of one dataset in one process (the main one or a worker)."""

    def __init__(self) -> None:
        self.own = dict.fromkeys(_COUNTS, 0)  # this process's timings, and finished readers
        self.by_url: dict[str, int] = {}
        self.reader: Any = None  # the ReadStats of the running iteration's reader
        self.workers: dict[int, WorkerNote] = {}  # the running iteration's, latest of each

    # -- reading the counters ------------------------------------------------------------
    def counts(self) -> tuple[dict[str, int], dict[str, int]]:
        """This process's counters and per-shard waits, the running reader's included."""
        counts, by_url = dict(self.own), dict(self.by_url)
        st = self.reader
        if st is not None:
            _add(counts, {k: getattr(st, k) for k in _READER})
            _add(by_url, st.wait_ns_by_url)
        return counts, by_url

    def stats(self, rank: int) -> StreamStats:
        """The rank's :class:`StreamStats`: this process plus its workers' latest notes."""
        counts, by_url = self.counts()
        for note in list(self.workers.values()):
            _add(counts, note.counts)
            _add(by_url, note.by_url)
        s = 1e-9
        waits = counts["get_wait_ns"] + counts["cache_wait_ns"]
        tar = max(0, counts["make_ns"] - waits - counts["collate_ns"])
        worst = max(by_url.items(), key=lambda kv: kv[1], default=("", 0))
        return StreamStats(
            rank=rank, wait_s=counts["wait_ns"] * s, batches=counts["batches"], gets=counts["gets"],
            bytes_read=counts["get_bytes"], cache_hits=counts["cache_hits"],
            get_s=counts["get_wait_ns"] * s, cache_wait_s=counts["cache_wait_ns"] * s, tar_s=tar * s,
            collate_s=(counts["collate_ns"] + counts["unpack_ns"]) * s, transport_s=counts["transport_ns"] * s,
            slowest_shard=worst[0], slowest_shard_s=worst[1] * s)

    # -- an iteration's life -------------------------------------------------------------
    def start_reader(self, read_stats: Any) -> None:
        """Count ``read_stats`` (a new iteration's reader) from now on."""
        self.end_reader()
        self.reader = read_stats

    def end_reader(self) -> None:
        """Fold the running reader's counters in (its iteration ended)."""
        st, self.reader = self.reader, None
        if st is not None:
            _add(self.own, {k: getattr(st, k) for k in _READER})
            _add(self.by_url, st.wait_ns_by_url)

    def end_workers(self) -> None:
        """Fold the workers' latest notes in (their iteration ended)."""
        notes, self.workers = self.workers, {}
        for note in notes.values():
            _add(self.own, note.counts)
            _add(self.by_url, note.by_url)

    # -- timing, per batch -----------------------------------------------------------------
    def timed(self, items: Iterable[Any], key: str, count: bool = False, also: str = "") -> Iterator[Any]:
        """``items``, adding the time spent inside their ``next()`` to counter ``key``
        (and to ``also``: one process times its wait and its making at once; and each
        item to ``batches`` if ``count``); closes ``items`` when closed."""
        it = iter(items)
        now, own = time.perf_counter_ns, self.own
        try:
            began = now()
            for item in it:
                spent = now() - began
                own[key] += spent
                if also:
                    own[also] += spent
                if count:
                    own["batches"] += 1
                yield item
                began = now()
            own[key] += now() - began
        finally:
            close = getattr(it, "close", None)
            if close is not None:
                close()

    def collate(self, began: int) -> None:
        """Add the collation that began at ``began`` (perf_counter_ns) and ends now."""
        self.own["collate_ns"] += time.perf_counter_ns() - began

    def noted(self, items: Iterable[Any]) -> Iterator[Any]:
        """In a DataLoader worker: each message as a PackedRun ending with a WorkerNote of
        this worker's counters so far (the main process strips it: :meth:`received`)."""
        info = get_worker_info()
        worker = 0 if info is None else info.id
        for item in items:
            run = item if isinstance(item, PackedRun) else PackedRun([item])
            counts, by_url = self.counts()
            run.append(WorkerNote(worker, counts, by_url))
            yield run

    def received(self, items: Iterable[Any]) -> Iterator[Any]:
        """In the main process: the workers' messages, timed as transport, their notes kept."""
        workers = self.workers
        for item in self.timed(items, "transport_ns"):
            if isinstance(item, PackedRun) and item and isinstance(item[-1], WorkerNote):
                note = item.pop()
                workers[note.worker] = note
            yield item
