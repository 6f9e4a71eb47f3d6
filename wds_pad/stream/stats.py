"""Where data time goes on this rank: :class:`StreamStats`, and the clock that counts it.

Invariants:
- counters are always on and cost, in the loop's process, two clock reads per batch
  (where its wait begins, where it is handed over: the least an exact
  wait takes, its two ends are apart by the training step) and two more around a
  collation that does more than list the samples (the batch maker's); with workers
  two more per message there and two per message in a worker; one per remote request
  in the reader: never per sample. On the per-batch path they add two numbers into one
  list: the wait, in float seconds of ``time.perf_counter``, into the slot of how the
  batch came (made in this process or received from workers; the wait is their sum),
  and the count: no dicts, attributes, branches or calls. The other timings are int
  nanoseconds of ``time.perf_counter_ns``, the same clock: a float costs less to
  subtract and add than the two-digit ints of a 44-bit nanosecond clock;
- ``wait_s`` is the time the training loop spent inside ``next()`` on the dataset or
  the Loader, in the main process;
- the stages split the time spent making batches: ``get_s`` and ``cache_wait_s`` are the
  waits of the reading thread on its ranged GETs and on the shard cache (the reader's
  :class:`~wds_pad.io.options.ReadStats`), ``collate_s`` is the time of the batches'
  collations (none for a collation that only lists the samples; in the main process
  with workers: all of its wait that is not
  ``transport_s``, the unpacking and collation), ``tar_s`` the rest of
  making a batch (local reads, tar headers and members, per-sample stages);
  ``transport_s`` is the main process's wait on its DataLoader workers' messages. In one
  process the stages add up to ``wait_s``; with workers they are summed over the
  workers, whose work overlaps the training step;
- a DataLoader worker sends its counters with the batches it already sends (the last
  element of each message, a :data:`WorkerNote`: a plain tuple of its counts and of the
  per-shard waits that changed since its previous note), never on a channel of its own;
  the main process keeps each worker's latest and sums them.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any, Iterable, Iterator

from torch.utils.data import get_worker_info

from .transport import PackedRun

__all__ = ["COLLATE", "Clock", "StreamStats", "WorkerNote"]

# waited_s: the loop's wait for batches made in its own process (which is their making
# too); received_s: its wait for batches received from workers; the wait is their sum
_COUNTS = ("waited_s", "batches", "make_ns", "collate_ns", "received_s", "transport_ns",
           "gets", "get_bytes", "cache_hits", "get_wait_ns", "cache_wait_ns")
WAITED, BATCHES, MAKE, COLLATE, RECEIVED, TRANSPORT = range(6)  # Clock.acc's own timings
#: ``Clock.acc[COLLATE]``: nanoseconds of collation, added by the batch maker that timed it
_READER = _COUNTS[6:]  # the reader's (ReadStats), folded in when its iteration ends
_FIRST_READER = len(_COUNTS) - len(_READER)
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


#: A worker's counters of its current iteration, riding as the last element of each message
#: it sends: ``(worker id, counts in _COUNTS order, the shard waits that changed since its
#: previous note)``. A plain tuple: it pickles and unpickles in a fraction of a class's time.
WorkerNote = tuple[int, tuple[float, ...], dict[str, int]]


def _add(into: dict[str, int], counts: dict[str, int]) -> None:
    for k, v in counts.items():
        into[k] = into.get(k, 0) + v


class Clock:
    """The counters of one dataset in one process (the main one or a worker)."""

    def __init__(self) -> None:
        # this process's timings and finished readers, in _COUNTS order
        self.acc: list[float] = [0] * len(_COUNTS)
        self.acc[WAITED] = self.acc[RECEIVED] = 0.0
        self.by_url: dict[str, int] = {}
        self.reader: Any = None  # the ReadStats of the running iteration's reader
        # the running iteration's workers: the latest counts of each, and its shards' waits
        self.workers: dict[int, tuple[tuple[float, ...], dict[str, int]]] = {}

    # -- reading the counters ------------------------------------------------------------
    def counts(self) -> list[float]:
        """This process's counters, in ``_COUNTS`` order, the running reader's included."""
        counts, st = self.acc[:], self.reader
        if st is not None:
            for i, k in enumerate(_READER, _FIRST_READER):
                counts[i] += getattr(st, k)
        return counts

    def stats(self, rank: int) -> StreamStats:
        """The rank's :class:`StreamStats`: this process plus its workers' latest notes."""
        own, by_url = self.counts(), dict(self.by_url)
        if self.reader is not None:
            _add(by_url, dict(self.reader.wait_ns_by_url))
        for note_counts, note_by_url in list(self.workers.values()):
            own = [a + b for a, b in zip(own, note_counts)]
            _add(by_url, dict(note_by_url))
        counts = dict(zip(_COUNTS, own))
        s = 1e-9
        waits = counts["get_wait_ns"] + counts["cache_wait_ns"]
        made = counts["make_ns"] + counts["waited_s"] * 1e9  # the workers' making, and this process's
        tar = max(0.0, made - waits - counts["collate_ns"])
        unpack = max(0.0, counts["received_s"] * 1e9 - counts["transport_ns"])  # the main process's rest
        worst = max(by_url.items(), key=lambda kv: kv[1], default=("", 0))
        return StreamStats(
            rank=rank, wait_s=counts["waited_s"] + counts["received_s"], batches=int(counts["batches"]),
            gets=int(counts["gets"]),
            bytes_read=int(counts["get_bytes"]), cache_hits=int(counts["cache_hits"]),
            get_s=counts["get_wait_ns"] * s, cache_wait_s=counts["cache_wait_ns"] * s, tar_s=tar * s,
            collate_s=(counts["collate_ns"] + unpack) * s, transport_s=counts["transport_ns"] * s,
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
            acc = self.acc
            for i, k in enumerate(_READER, _FIRST_READER):
                acc[i] += getattr(st, k)
            _add(self.by_url, st.wait_ns_by_url)

    def end_workers(self) -> None:
        """Fold the workers' latest notes in (their iteration ended)."""
        notes, self.workers = self.workers, {}
        acc = self.acc
        for counts, by_url in notes.values():
            for i, v in enumerate(counts):
                acc[i] += v
            _add(self.by_url, by_url)

    # -- timing, per batch -----------------------------------------------------------------
    def waited(self, items: Iterable[Any], making: bool) -> Iterator[Any]:
        """The training loop's side: ``items`` (batches), the time spent inside their
        ``next()`` added to ``waited_s`` if they are made in this process (``making``:
        the wait is their making), else to ``received_s``; each counted in ``batches``.
        Closes ``items`` when closed."""
        it = iter(items)
        now, acc, into = time.perf_counter, self.acc, WAITED if making else RECEIVED
        try:
            began = now()
            for item in it:
                acc[into] += now() - began
                acc[BATCHES] += 1
                yield item
                began = now()
            acc[into] += now() - began
        finally:
            _close(it)

    def made(self, items: Iterable[Any]) -> Iterator[Any]:
        """In a DataLoader worker: ``items`` (messages), the time spent making them added to
        ``make_ns``. Closes ``items`` when closed."""
        it = iter(items)
        now, acc = time.perf_counter_ns, self.acc
        try:
            began = now()
            for item in it:
                acc[MAKE] += now() - began
                yield item
                began = now()
            acc[MAKE] += now() - began
        finally:
            _close(it)

    def noted(self, items: Iterable[Any]) -> Iterator[Any]:
        """In a DataLoader worker: each message as a PackedRun ending with a WorkerNote of
        this worker's counters so far (the main process strips it: :meth:`received`).
        A worker's clock counts one iteration, so its shard waits are its reader's: a
        note carries those the reader waited on since the previous note (none, mostly)."""
        info = get_worker_info()
        worker = 0 if info is None else info.id
        for item in items:
            run = item if isinstance(item, PackedRun) else PackedRun([item])
            st, changed = self.reader, {}
            if st is not None and st.waited_urls:
                waits, urls = st.wait_ns_by_url, st.waited_urls
                changed = {u: waits[u] for u in urls}  # the reader runs in this thread
                urls.clear()
            note: WorkerNote = (worker, tuple(self.counts()), changed)
            run.append(note)
            yield run

    def received(self, items: Iterable[Any]) -> Iterator[Any]:
        """In the main process: the workers' messages (each a PackedRun that
        :meth:`noted` ended with its note), the wait on each added to ``transport_ns``,
        their notes taken off and kept. Closes ``items`` when closed."""
        it = iter(items)
        now, acc, workers = time.perf_counter_ns, self.acc, self.workers
        try:
            began = now()
            for item in it:
                acc[TRANSPORT] += now() - began
                worker, counts, changed = item.pop()
                kept = workers.get(worker)
                by_url = {} if kept is None else kept[1]
                by_url.update(changed)  # the shards whose wait changed: their totals
                workers[worker] = (counts, by_url)
                yield item
                began = now()
        finally:
            _close(it)


def _close(it: Iterator[Any]) -> None:
    close = getattr(it, "close", None)
    if close is not None:
        close()
